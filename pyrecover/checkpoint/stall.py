"""The loop's checkpoint stall, each lost second counted once.

The loop loses time to checkpoints in two ways. The host blocks in the manager's calls
(`at_step`, `before_update`). And on CUDA the loop's stream can stand still at a fence, waiting
for a staging copy, while the host goes on (staging.py); CUDA events time that wait. The two
can be the same time: with memory mode snapshotting every step, the loop's stream waits for
copy N at the fence before the update, and the host, a moment later, blocks on the same copy
before it starts snapshot N+1; both end when copy N ends. The stall is therefore their union on
the host's clock, not their sum: a device wait counts only where no host wait covered it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable


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
