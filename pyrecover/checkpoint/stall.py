"""The loop's checkpoint stall, each lost second counted once, and each save's share of it.

The loop loses time to checkpoints in two ways. The host blocks in the manager's calls
(`at_step`, `before_update`). And on CUDA the loop's stream can stand still at a fence, waiting
for a staging copy, while the host goes on (staging.py); CUDA events time that wait. The two
can be the same time: with memory mode snapshotting every step, the loop's stream waits for
copy N at the fence before the update, and the host, a moment later, blocks on the same copy
before it starts snapshot N+1; both end when copy N ends. The stall is therefore their union on
the host's clock, not their sum: a device wait counts only where no host wait covered it.

A save's own `blocked` (its `checkpoint` event) is its share of that stall (Laps): what the
boundaries from its start to its commit waited for it, the commit's fsyncs and manifest
included, and the waits for its copy. Without snapshots (memory mode's are no save's) the
saves' `blocked` add up to the stall.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyrecover.checkpoint.interval import Clock
    from pyrecover.checkpoint.mode import TrainArg
    from pyrecover.checkpoint.store import Pending


def covered(start: float, end: float, spans: Iterable[tuple[float, float]]) -> float:
    """covered is how much of [start, end] lies inside the union of `spans`."""
    total, reach = 0.0, start
    for lo, hi in sorted(spans):
        lo, hi = max(lo, reach), min(hi, end)
        if hi > lo:
            total += hi - lo
            reach = hi
    return total


class StallClock:
    """StallClock keeps the host's recent blocked spans and counts device waits against them."""

    def __init__(self, keep: int = 64) -> None:
        # A device wait ends at most a few steps after the host spans it can overlap; 64
        # spans is two per step for 32 steps.
        self.spans: deque[tuple[float, float]] = deque(maxlen=keep)
        self.open_since: float | None = None  # the host call blocking right now

    def begin(self) -> float:
        self.open_since = time.perf_counter()
        return self.open_since

    def end(self, started: float) -> float:
        """end closes the host span begun at `started`; returns its seconds."""
        now = time.perf_counter()
        self.spans.append((started, now))
        self.open_since = None
        return now - started

    def forget(self) -> float:
        """forget drops the host span begun last (a call that waited for nothing): 0 seconds."""
        self.open_since = None
        return 0.0

    def device(self, waits: Iterable[tuple[float, float]]) -> float:
        """device is the seconds of the device waits, each (seconds, ended at on the host's
        perf_counter clock), that no host span, closed or still open, already covers."""
        spans = list(self.spans)
        if self.open_since is not None:
            spans.append((self.open_since, time.perf_counter()))
        return sum(max(0.0, seconds - covered(ended - seconds, ended, spans))
                   for seconds, ended in waits)


@dataclass
class InFlight:
    """A save begun and not yet committed. `blocked` is every second the loop waited for it so
    far (Laps): its start, the waits for its copy, its polls, its commit."""

    pending: Pending
    train: TrainArg
    started: float
    blocked: float
    since: Clock | None = None  # auto: the clock this save counted from (manager._retune)
    clock: Clock | None = None  # auto: the clock at this save's start


class Laps:
    """Laps hands the seconds a manager call blocks the loop to the save they were spent for,
    so that the saves' `blocked` add up to the loop's stall (each second counted once).

    A call's seconds up to a commit are that save's, a start's so far the new save's; the rest
    of a call (retention after a commit; the first step boundary's, which has the copy's
    thread allocate the buffers) is owed to the next save to start, where the loop's stall
    counted it."""

    def __init__(self) -> None:
        self.mark: float | None = None  # the open call's seconds not handed to a save yet
        self.owed = 0.0

    def open(self, at: float) -> None:
        self.mark = at

    def lap(self) -> float:
        """lap: the open call's seconds since it began or since the previous lap (0 with none
        open: a wait the loop's stall does not count either)."""
        if self.mark is None:
            return 0.0
        now = time.perf_counter()
        seconds, self.mark = now - self.mark, now
        return seconds

    def owe(self) -> None:
        """owe keeps the seconds since the previous lap for the next save to start."""
        self.owed += self.lap()

    def start(self) -> float:
        """start: what a save that has just started blocked the loop: its start, and what was
        owed to it."""
        took, self.owed = self.owed + self.lap(), 0.0
        return took

    def close(self, flight: InFlight | None, counted: bool) -> None:
        """close ends the call: its last seconds are the save's in flight, else owed to the next
        one where the loop's stall counted them (`counted`)."""
        if flight is not None:
            flight.blocked += self.lap()
        elif counted:
            self.owe()
        self.mark = None
