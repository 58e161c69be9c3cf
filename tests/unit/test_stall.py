"""The loop's checkpoint stall counts each lost second once (checkpoint/stall.py).

On CUDA a wait of the loop's stream at a fence and a wait of the host for the same copy can be
the same seconds; the GPU run that showed it (memory mode, a snapshot every step) cannot run
here, but the rule can: host spans plus the device waits counted must be the length of the
union of all of them."""

from __future__ import annotations

import random
from types import SimpleNamespace

from pyrecover.checkpoint import stall
from pyrecover.checkpoint.stall import Laps, StallClock, covered


def union_length(spans: list[tuple[float, float]]) -> float:
    total, reach = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > reach:
            total += hi - max(lo, reach)
            reach = hi
    return total


def disjoint(rng: random.Random, n: int, start: float) -> list[tuple[float, float]]:
    """n spans one after another, with gaps, as one thread's waits are."""
    spans, t = [], start
    for _ in range(n):
        t += rng.uniform(0.0, 0.3)
        length = rng.uniform(0.001, 0.4)
        spans.append((t, t + length))
        t += length
    return spans


def test_host_spans_plus_counted_device_waits_are_the_union_of_both():
    rng = random.Random(13)
    for _ in range(500):
        host = disjoint(rng, rng.randint(0, 6), rng.uniform(0, 1))
        device = disjoint(rng, rng.randint(0, 6), rng.uniform(0, 1))
        clock = StallClock()
        clock.spans.extend(host)
        counted = clock.device([(hi - lo, hi) for lo, hi in device])
        host_total = sum(hi - lo for lo, hi in host)
        assert abs(host_total + counted - union_length(host + device)) < 1e-9


def test_a_snapshot_every_step_on_cuda_is_not_counted_twice():
    """The case that was: the stream waits for copy N from 10.00 s to 10.40 s; the host blocks
    on the same copy from 10.01 s, and on its exchange until 10.45 s."""
    clock = StallClock()
    clock.spans.append((10.01, 10.45))
    assert abs(clock.device([(0.40, 10.40)]) - 0.01) < 1e-9  # 10.00 to 10.01 only
    # A wait the host never saw (DCP's copy, fenced long before its commit) counts whole.
    assert abs(clock.device([(0.30, 12.0)]) - 0.30) < 1e-9


def test_a_host_call_still_blocking_covers_device_waits_that_ended_inside_it():
    import time

    clock = StallClock()
    clock.begin()
    clock.open_since = time.perf_counter() - 1.0  # a call blocking for a second so far
    now = time.perf_counter()
    assert clock.device([(0.5, now - 0.2)]) == 0.0  # all of it inside the call
    assert abs(clock.device([(0.5, now - 0.8)]) - 0.3) < 1e-3  # 0.2 s of it inside
    assert clock.device([(0.5, now - 2.0)]) == 0.5  # before the call
    assert clock.end(clock.open_since) >= 1.0 and clock.open_since is None


def test_covered_clips_to_the_interval_and_merges_overlapping_spans():
    assert covered(0.0, 1.0, []) == 0.0
    assert covered(0.0, 1.0, [(-1.0, 0.25), (0.5, 0.75), (0.6, 2.0)]) == 0.75
    assert covered(0.0, 1.0, [(2.0, 3.0)]) == 0.0


def test_laps_hand_each_blocked_second_to_the_save_it_was_for(monkeypatch):
    """A step boundary's seconds up to a commit are that save's, a start's the new save's, the
    rest owed to the next save (where the loop's stall counted them); a snapshot's and those
    outside a manager call are no save's. A stand-in clock makes the seconds exact."""
    now = [0.0]
    monkeypatch.setattr(stall.time, "perf_counter", lambda: now[0])

    def after(seconds: float) -> float:
        now[0] += seconds
        return laps.lap()

    laps = Laps()
    laps.open(now[0])  # the first boundary: the buffers, 0.5 s, owed to the first save
    now[0] += 0.5
    laps.owe()
    laps.close(None, counted=True)
    assert after(9.0) == 0.0  # a step outside any call
    laps.open(now[0])  # a boundary that starts a save (1 s) and polls it (0.25 s)
    now[0] += 1.0
    flight = SimpleNamespace(blocked=laps.start())
    assert flight.blocked == 1.5
    now[0] += 0.25
    laps.close(flight, counted=True)
    assert flight.blocked == 1.75
    laps.open(now[0])  # a boundary that snapshots (2 s), commits (0.5 s) and retires (0.125)
    assert after(2.0) == 2.0  # the snapshot's own: dropped
    flight.blocked += after(0.5)
    assert flight.blocked == 2.25
    now[0] += 0.125  # the boundary goes on after the commit's record: owed
    laps.close(None, counted=True)
    now[0] += 9.0
    laps.open(now[0])  # the next save's start, 0.375 s
    now[0] += 0.375
    assert laps.start() == 0.5
    now[0] += 0.25  # a boundary the loop's stall does not count: no save's either
    laps.close(None, counted=False)
    laps.open(now[0])
    assert laps.start() == 0.0
