"""`pyrecover plot`: loss against step, with the run's checkpoints and interruptions marked.

Reads `metrics.jsonl` and `events.jsonl` and writes a PNG with nothing but the standard
library: a small RGB canvas, straight lines, a 5x7 bitmap font, and zlib for the PNG. A plot
of a few curves and marks does not need matplotlib, and the login node stays free of it.

Marks (vertical lines at the step they happened):
- checkpoint: a green tick along the bottom of the plot and a faint dotted line;
- resume: blue, at the step the run resumed from, labelled with the steps it had to redo;
- crash / error: red, at the last step logged before the event;
- stop / requeue / signal: orange.
A resumed run redoes the steps after its checkpoint: each start's curve is drawn in turn, so
the redone stretch is drawn over the lost one.
"""

from __future__ import annotations

import math
import struct
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyrecover.rundir import RunDir, read_jsonl

Color = tuple[int, int, int]
WHITE: Color = (255, 255, 255)
BLACK: Color = (0, 0, 0)
GRID: Color = (228, 228, 228)
AXIS: Color = (90, 90, 90)
LOSS: Color = (40, 40, 40)
CHECKPOINT: Color = (44, 160, 44)
CHECKPOINT_LINE: Color = (190, 225, 190)
RESUME: Color = (31, 119, 180)
CRASH: Color = (214, 39, 40)
STOP: Color = (255, 127, 14)

# Which events mark an interruption, and in which color.
MARKS: dict[str, Color] = {"resume": RESUME, "crash": CRASH, "error": CRASH, "stop": STOP,
                           "requeue": STOP, "signal": STOP}


class PlotError(ValueError):
    """The run directory has nothing to plot; the message says what is missing."""


# --- a 5x7 bitmap font: each glyph is 7 rows of 5 pixels ('#' = ink) -------------------------

_FONT_ROWS = {
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "C": (".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."),
    "D": ("###..", "#..#.", "#...#", "#...#", "#...#", "#..#.", "###.."),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "G": (".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".####"),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "I": (".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "J": ("..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"),
    "N": ("#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"),
    "O": (".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "P": ("####.", "#...#", "#...#", "####.", "#....", "#....", "#...."),
    "Q": (".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "V": ("#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "W": ("#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
    "Y": ("#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."),
    "Z": ("#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"),
    ".": (".....", ".....", ".....", ".....", ".....", ".##..", ".##.."),
    ",": (".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."),
    "-": (".....", ".....", ".....", "#####", ".....", ".....", "....."),
    "+": (".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."),
    ":": (".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."),
    "/": (".....", "....#", "...#.", "..#..", ".#...", "#....", "....."),
    "_": (".....", ".....", ".....", ".....", ".....", ".....", "#####"),
    "(": ("...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."),
    ")": (".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."),
    "=": (".....", ".....", "#####", ".....", "#####", ".....", "....."),
    "?": (".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."),
    " ": (".....",) * 7,
}
GLYPH_W, GLYPH_H = 5, 7


class Canvas:
    """An RGB image in memory with the few drawing operations a line plot needs."""

    def __init__(self, width: int, height: int, background: Color = WHITE) -> None:
        self.width, self.height = width, height
        self.pixels = bytearray(bytes(background) * (width * height))

    def set(self, x: int, y: int, color: Color) -> None:
        if 0 <= x < self.width and 0 <= y < self.height:
            i = 3 * (y * self.width + x)
            self.pixels[i:i + 3] = bytes(color)

    def get(self, x: int, y: int) -> Color:
        i = 3 * (y * self.width + x)
        return (self.pixels[i], self.pixels[i + 1], self.pixels[i + 2])

    def rect(self, x0: int, y0: int, x1: int, y1: int, color: Color) -> None:
        """rect fills the box from (x0, y0) to (x1, y1), both included."""
        for y in range(max(0, y0), min(self.height, y1 + 1)):
            for x in range(max(0, x0), min(self.width, x1 + 1)):
                self.set(x, y, color)

    def vline(self, x: int, y0: int, y1: int, color: Color, dash: int = 0) -> None:
        for y in range(min(y0, y1), max(y0, y1) + 1):
            if not dash or (y // dash) % 2 == 0:
                self.set(x, y, color)

    def hline(self, x0: int, x1: int, y: int, color: Color, dash: int = 0) -> None:
        for x in range(min(x0, x1), max(x0, x1) + 1):
            if not dash or (x // dash) % 2 == 0:
                self.set(x, y, color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, width: int = 1) -> None:
        """line draws with Bresenham's algorithm; width > 1 thickens it downwards."""
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            for k in range(width):
                self.set(x0, y0 + k, color)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, text: str, color: Color, scale: int = 2) -> int:
        """text draws upper-cased `text` with its top-left corner at (x, y); returns its width."""
        cx = x
        for ch in text.upper():
            rows = _FONT_ROWS.get(ch, _FONT_ROWS["?"])
            for r, row in enumerate(rows):
                for c, ink in enumerate(row):
                    if ink == "#":
                        self.rect(cx + c * scale, y + r * scale, cx + (c + 1) * scale - 1,
                                  y + (r + 1) * scale - 1, color)
            cx += (GLYPH_W + 1) * scale
        return cx - x

    def png(self) -> bytes:
        """png encodes the canvas as an 8-bit RGB PNG (filter 0 on every row)."""
        stride = 3 * self.width
        raw = b"".join(b"\x00" + bytes(self.pixels[y * stride:(y + 1) * stride])
                       for y in range(self.height))
        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header)
                + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b""))


def text_width(text: str, scale: int = 2) -> int:
    return len(text) * (GLYPH_W + 1) * scale


def _chunk(kind: bytes, data: bytes) -> bytes:
    return (struct.pack(">I", len(data)) + kind + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))


# --- what to draw --------------------------------------------------------------------------

@dataclass
class Series:
    """One start's logged losses, in step order."""

    steps: list[int] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Mark:
    step: int
    kind: str  # checkpoint, resume, crash, error, stop, requeue, signal
    label: str = ""  # drawn beside the mark: the steps a resume had to redo


def segments(metrics: Iterable[Mapping[str, Any]]) -> list[Series]:
    """segments splits metrics.jsonl into one series per start: a new one where step drops."""
    out: list[Series] = []
    last = None
    for m in metrics:
        step, loss = m.get("step"), m.get("loss")
        if not isinstance(step, int) or not isinstance(loss, (int, float)):
            continue
        if not math.isfinite(loss):
            continue
        if last is None or step <= last:
            out.append(Series())
        out[-1].steps.append(step)
        out[-1].losses.append(float(loss))
        last = step
    return out


def marks(events: Iterable[Mapping[str, Any]],
          metrics: Sequence[Mapping[str, Any]] = ()) -> list[Mark]:
    """marks lists checkpoints and interruptions with their step.

    An event without a step (a crash) is placed at the last step logged before it.
    """
    timeline = sorted((float(m.get("time", 0.0)), int(m["step"])) for m in metrics
                      if isinstance(m.get("step"), int))
    out = []
    for e in events:
        kind = e.get("event")
        if kind != "checkpoint" and kind not in MARKS:
            continue
        step = e.get("step")
        if not isinstance(step, int):
            t = float(e.get("time", 0.0))
            before = [s for when, s in timeline if when <= t]
            if not before:
                continue
            step = before[-1]
        lost = e.get("steps_lost") if kind == "resume" else None
        out.append(Mark(step, str(kind), f"lost {lost}" if isinstance(lost, int) else ""))
    return out


@dataclass(frozen=True)
class Layout:
    """Where the data lands in the picture: the plot box and the axis ranges."""

    left: int
    top: int
    right: int
    bottom: int
    x_min: float
    x_max: float
    y_min: float
    y_max: float

    def x(self, step: float) -> int:
        span = (self.x_max - self.x_min) or 1.0
        return round(self.left + (step - self.x_min) / span * (self.right - self.left))

    def y(self, value: float) -> int:
        span = (self.y_max - self.y_min) or 1.0
        return round(self.bottom - (value - self.y_min) / span * (self.bottom - self.top))


def nice_ticks(lo: float, hi: float, count: int = 6) -> list[float]:
    """nice_ticks returns round values (1, 2 or 5 times a power of ten) covering lo..hi."""
    if not math.isfinite(lo) or not math.isfinite(hi):
        return []
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks, k = [], 0
    while first + k * step <= hi + 1e-9 * step:
        ticks.append(first + k * step)
        k += 1
    return ticks


def _fmt(value: float, step: float) -> str:
    if abs(value) < 1e-12:
        return "0"
    if step >= 1 and abs(value) < 1e6:
        return f"{value:.0f}"
    digits = max(0, -math.floor(math.log10(step))) if step > 0 else 2
    return f"{value:.{min(digits, 6)}f}"


def render(run: RunDir, width: int = 960, height: int = 540) -> tuple[bytes, Layout]:
    """render draws the run's loss and marks; returns the PNG bytes and the layout used."""
    metrics = list(read_jsonl(run.metrics))
    events = list(read_jsonl(run.events))
    series = segments(metrics)
    if not series:
        raise PlotError(f"{run.metrics}: no logged losses to plot yet")
    found = marks(events, metrics)
    steps = [s for ser in series for s in ser.steps] + [m.step for m in found]
    losses = [v for ser in series for v in ser.losses]
    lo, hi = min(losses), max(losses)
    pad = (hi - lo) * 0.05 or max(abs(lo) * 0.05, 0.5)
    y_ticks = nice_ticks(lo - pad, hi + pad)
    x_ticks = nice_ticks(0, max(steps))
    layout = Layout(left=90, top=70, right=width - 30, bottom=height - 60,
                    x_min=0, x_max=max(x_ticks[-1], max(steps)),
                    y_min=min(y_ticks[0], lo - pad), y_max=max(y_ticks[-1], hi + pad))
    canvas = Canvas(width, height)
    _axes(canvas, layout, x_ticks, y_ticks)
    for m in found:  # checkpoints first: interruptions are drawn over them
        if m.kind == "checkpoint":
            x = layout.x(m.step)
            canvas.vline(x, layout.top, layout.bottom, CHECKPOINT_LINE, dash=4)
            canvas.rect(x - 1, layout.bottom - 12, x + 1, layout.bottom - 1, CHECKPOINT)
    for ser in series:
        points = [(layout.x(s), layout.y(v)) for s, v in zip(ser.steps, ser.losses, strict=True)]
        if len(points) == 1:
            canvas.rect(points[0][0] - 1, points[0][1] - 1, points[0][0] + 1, points[0][1] + 1,
                        LOSS)
        for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
            canvas.line(x0, y0, x1, y1, LOSS, width=2)
    for m in found:
        if m.kind in MARKS:
            x = layout.x(m.step)
            canvas.rect(x - 1, layout.top, x, layout.bottom, MARKS[m.kind])
            if m.label:
                canvas.text(x + 5, layout.top + 4, m.label, MARKS[m.kind])
    _legend(canvas, layout, run.root.name, {m.kind for m in found})
    return canvas.png(), layout


def write(run_dir: str | Path, out: str | Path, width: int = 960, height: int = 540) -> Layout:
    """write renders the plot of `run_dir` into the PNG file `out`."""
    run = RunDir(Path(run_dir))
    if not run.root.is_dir():
        raise PlotError(f"run directory {str(run.root)!r} does not exist")
    if width < 320 or height < 200:
        raise PlotError(f"{width}x{height} is too small; use at least 320x200")
    data, layout = render(run, width, height)
    Path(out).write_bytes(data)
    return layout


def _axes(canvas: Canvas, lay: Layout, x_ticks: list[float], y_ticks: list[float]) -> None:
    x_step = x_ticks[1] - x_ticks[0] if len(x_ticks) > 1 else 1.0
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else 1.0
    for v in y_ticks:
        y = lay.y(v)
        canvas.hline(lay.left, lay.right, y, GRID)
        canvas.hline(lay.left - 5, lay.left - 1, y, AXIS)
        label = _fmt(v, y_step)
        canvas.text(lay.left - 8 - text_width(label), y - GLYPH_H, label, AXIS)
    for v in x_ticks:
        x = lay.x(v)
        canvas.vline(x, lay.bottom + 1, lay.bottom + 5, AXIS)
        label = _fmt(v, x_step)
        canvas.text(x - text_width(label) // 2, lay.bottom + 10, label, AXIS)
    canvas.hline(lay.left, lay.right, lay.bottom, AXIS)
    canvas.vline(lay.left, lay.top, lay.bottom, AXIS)
    canvas.text((lay.left + lay.right - text_width("step")) // 2, lay.bottom + 34, "step", AXIS)
    canvas.text(10, lay.top - 24, "loss", AXIS)


def _legend(canvas: Canvas, lay: Layout, title: str, kinds: set[str]) -> None:
    canvas.text(lay.left, 12, title[:60], BLACK)
    entries = [("loss", LOSS), ("checkpoint", CHECKPOINT), ("resume", RESUME),
               ("crash/error", CRASH), ("stop/requeue", STOP)]
    present = {"loss", "checkpoint" if "checkpoint" in kinds else "",
               "resume" if "resume" in kinds else "",
               "crash/error" if kinds & {"crash", "error"} else "",
               "stop/requeue" if kinds & {"stop", "requeue", "signal"} else ""}
    x, y = lay.left, 40
    for label, color in entries:
        if label not in present:
            continue
        canvas.rect(x, y + 2, x + 15, y + 11, color)
        x += 22 + canvas.text(x + 22, y, label, AXIS) + 16
