"""A one-line progress bar for a person at an interactive terminal (rank 0 only).

In a batch log (stderr is not a TTY) there is no bar: the loop writes one compact line every
`train.log_interval` steps instead, so a job log never fills with carriage returns. While the
bar is shown, every other log line first clears it and the bar is redrawn below that line.
"""

from __future__ import annotations

import logging
import shutil
import sys
import time
from typing import TextIO

REDRAW_S = 0.1  # at most ten redraws a second
EMA = 0.1  # weight of the newest step in the smoothed step time


def for_terminal(rank: int, total: int, start: int, stream: TextIO | None = None,
                 logger: str = "pyrecover") -> Progress | None:
    """for_terminal returns a bar for rank 0 when `stream` (stderr) is a TTY, else None."""
    stream = stream if stream is not None else sys.stderr
    if rank != 0 or not _isatty(stream):
        return None
    return Progress(total, start, stream, logging.getLogger(logger))


def render(step: int, total: int, loss: float, tokens_per_s: float, seconds_left: float,
           width: int) -> str:
    """render is the bar's text for a terminal `width` columns wide (pure, for tests)."""
    pct = 100.0 * step / max(1, total)
    tail = (f" {step}/{total} {pct:3.0f}%  loss {loss:.4f}  {_si(tokens_per_s)} tok/s  "
            f"{_clock(seconds_left)} left")
    bar_width = max(0, min(40, width - len(tail) - 3))
    filled = round(bar_width * step / max(1, total))
    bar = f"[{'#' * filled}{'.' * (bar_width - filled)}]" if bar_width >= 5 else ""
    return (bar + tail)[: max(1, width - 1)]


class Progress:
    def __init__(self, total: int, start: int, stream: TextIO,
                 logger: logging.Logger | None = None) -> None:
        self.total, self.stream = total, stream
        self.shown = False
        self._step_s: float | None = None
        self._updates = 0
        self._last_step, self._last_time = start, time.perf_counter()
        self._drawn_at = 0.0
        self._tokens_per_step = 0
        self._loss = float("nan")
        self._step = start
        # Log lines go through the same terminal: make them clear the bar first.
        self._handlers = [h for h in (logger.handlers if logger else [])
                          if isinstance(h, logging.StreamHandler) and h.stream is stream]
        for h in self._handlers:
            h.setStream(_ClearingStream(stream, self))

    def update(self, step: int, loss: float, tokens_per_step: int) -> None:
        """update records the step just finished and redraws when it is time to."""
        now = time.perf_counter()
        steps = step - self._last_step
        if steps > 0 and self._updates > 0:  # the first step carries start-up time: skipped
            per_step = (now - self._last_time) / steps
            weight = max(EMA, 1.0 / self._updates)  # a plain mean until the EMA has history
            self._step_s = per_step if self._step_s is None else \
                (1 - weight) * self._step_s + weight * per_step
        self._updates += 1
        self._last_step, self._last_time = step, now
        self._step, self._loss, self._tokens_per_step = step, loss, tokens_per_step
        if not self.shown or now - self._drawn_at >= REDRAW_S or step >= self.total:
            self.draw()

    def draw(self) -> None:
        step_s = self._step_s or 0.0
        rate = self._tokens_per_step / step_s if step_s > 0 else 0.0
        width = shutil.get_terminal_size((100, 20)).columns
        text = render(self._step, self.total, self._loss, rate,
                      step_s * max(0, self.total - self._step), width)
        self.stream.write("\r" + text + "\x1b[K")
        self.stream.flush()
        self.shown, self._drawn_at = True, time.perf_counter()

    def clear(self) -> None:
        if self.shown:
            self.stream.write("\r\x1b[K")
            self.shown = False

    def close(self) -> None:
        """close leaves the last bar on screen and gives the stream back to the log handlers."""
        if self.shown:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()
            self.shown = False
        for h in self._handlers:
            h.setStream(self.stream)
        self._handlers = []


class _ClearingStream:
    """A stream that clears the progress bar's line before anything else is written."""

    def __init__(self, stream: TextIO, progress: Progress) -> None:
        self._stream, self._progress = stream, progress

    def write(self, text: str) -> int:
        self._progress.clear()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def isatty(self) -> bool:
        return _isatty(self._stream)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _si(value: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= scale:
            return f"{value / scale:.1f}{unit}"
    return f"{value:.0f}"


def _clock(seconds: float) -> str:
    s = int(max(0.0, seconds))
    h, rest = divmod(s, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"
