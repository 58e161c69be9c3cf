"""Straggler detection: a rank whose own compute time stays well above the other ranks'.

Every `interval` steps each rank shares its mean own compute time per step over the window
(one all-gather of one float; `Watchdog.step_done` measures it: the phases that never wait on
another rank, so a slow rank does not make the fast ones look slow too). A rank slower than
its reference (`reference`: the median of the faster half of the other ranks) by `factor`
in `windows` windows in a row is a straggler: rank 0 records a `straggler` event and logs a
line, again after every further `windows` slow windows.

The reference leaves the rank itself and the slower half out: against the median of all
ranks, a slow one of two never counted below 3x at factor 1.5 (the median of two is their
mean), nor at any factor >= 2, and neither did the ranks of one slow node of two.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("pyrecover")


def reference(times: list[float], rank: int) -> float:
    """reference is what `rank`'s time is held against: the median of the faster half (the
    larger half where the count is odd) of the other ranks' times."""
    others = sorted(t for r, t in enumerate(times) if r != rank)
    return statistics.median(others[:(len(others) + 1) // 2])


def slow_ranks(times: list[float], factor: float) -> list[int]:
    """slow_ranks lists the ranks whose time exceeds `factor` x their reference."""
    if len(times) < 2:
        return []
    return [r for r, t in enumerate(times) if t > factor * reference(times, r) and t > 0]


def update_streaks(streaks: list[int], slow: list[int]) -> list[int]:
    """update_streaks counts, per rank, the slow windows in a row (0 after a normal one)."""
    return [s + 1 if r in slow else 0 for r, s in enumerate(streaks)]


def due(streak: int, windows: int) -> bool:
    """due tells whether a streak of slow windows is reported now: at `windows`, `2 windows`..."""
    return streak > 0 and streak % windows == 0


@dataclass
class Straggler:
    rank: int
    node: str
    seconds: float
    """Its own compute time per step, mean over the window."""
    reference: float
    """The median of the faster half of the other ranks' times (`reference`)."""
    windows: int
    step: int


def gather_times(own: float, world_size: int) -> list[float]:
    """gather_times is every rank's `own` value, on every rank (one all-gather of one float).

    A CPU tensor: the process group routes it to gloo, also on GPUs (`cpu:gloo,cuda:nccl`).
    """
    import torch
    import torch.distributed as tdist

    if world_size < 2 or not tdist.is_initialized():
        return [own]
    mine = torch.tensor([own], dtype=torch.float64)
    out = [torch.zeros(1, dtype=torch.float64) for _ in range(world_size)]
    tdist.all_gather(out, mine)
    return [float(t.item()) for t in out]


@dataclass
class StragglerWatch:
    """What the loop calls after every step; every rank calls it at the same steps."""

    interval: int
    factor: float
    windows: int
    world_size: int
    nodes: list[str]
    """Host name of every rank (gathered once at start)."""
    gather: Callable[[float, int], list[float]] = gather_times
    _sum: float = 0.0
    _count: int = 0
    streaks: list[int] = field(default_factory=list)

    def after_step(self, step: int, own_seconds: float) -> list[Straggler]:
        """after_step adds one step's own time; at the end of a window, shares and judges."""
        if self.interval <= 0 or self.world_size < 2:
            return []
        self._sum += own_seconds
        self._count += 1
        if step % self.interval:
            return []
        mean = self._sum / self._count
        self._sum, self._count = 0.0, 0
        times = self.gather(mean, self.world_size)
        if not self.streaks:
            self.streaks = [0] * len(times)
        self.streaks = update_streaks(self.streaks, slow_ranks(times, self.factor))
        return [Straggler(r, self.nodes[r] if r < len(self.nodes) else "?", round(t, 6),
                          round(reference(times, r), 6), self.streaks[r], step)
                for r, t in enumerate(times) if due(self.streaks[r], self.windows)]


def report(found: list[Straggler], event: Callable[..., object]) -> None:
    """report logs each straggler and records a `straggler` event (rank 0 calls it)."""
    for s in found:
        log.warning("straggler: rank %d on %s takes %.3fs of its own compute per step, %.1fx "
                    "the other ranks' %.3fs, for %d windows in a row (step %d)", s.rank, s.node,
                    s.seconds, s.seconds / s.reference if s.reference else float("inf"),
                    s.reference, s.windows, s.step)
        event("straggler", rank=s.rank, node=s.node, seconds=s.seconds, reference=s.reference,
              windows=s.windows, step=s.step)
