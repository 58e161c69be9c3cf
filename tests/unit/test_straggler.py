"""Straggler detection over per-rank compute times (the all-gather replaced by a table)."""

from __future__ import annotations

from pyrecover import straggler
from pyrecover.straggler import StragglerWatch, slow_ranks


def test_a_rank_slower_than_the_other_ranks_by_the_factor_is_slow():
    assert slow_ranks([0.10, 0.11, 0.35, 0.10], 1.5) == [2]
    assert slow_ranks([0.10, 0.11, 0.14, 0.10], 1.5) == []
    assert slow_ranks([0.10], 1.5) == []


def test_a_slow_rank_of_two_and_a_slow_node_of_two_are_found_at_any_factor():
    """Against the median of all ranks, a slow rank of two was never slow below 3x at factor
    1.5 (the median of two is their mean) nor at any factor >= 2, nor half the ranks."""
    assert slow_ranks([1.0, 2.9], 1.5) == [1]
    assert slow_ranks([1.0, 100.0], 2.0) == [1]
    assert slow_ranks([1.0, 1.0, 1.0, 1.0, 2.9, 2.9, 2.9, 2.9], 1.5) == [4, 5, 6, 7]
    assert slow_ranks([1.0, 1.4], 1.5) == [] and slow_ranks([2.0, 2.0, 2.0, 2.0], 1.5) == []


def watch(times_by_window: list[list[float]], windows: int = 3) -> tuple[StragglerWatch, list]:
    feed = iter(times_by_window)
    sent: list[float] = []

    def gather(own: float, world_size: int) -> list[float]:
        sent.append(own)
        return next(feed)

    w = StragglerWatch(interval=2, factor=1.5, windows=windows, world_size=4,
                       nodes=["a", "a", "b", "b"], gather=gather)
    return w, sent


def test_a_straggler_is_reported_after_several_slow_windows_in_a_row_only():
    slow, normal = [0.1, 0.1, 0.4, 0.1], [0.1, 0.1, 0.1, 0.1]
    w, sent = watch([slow, slow, normal, slow, slow, slow, slow, slow, slow])
    found = []
    for step in range(1, 19):
        found += w.after_step(step, 0.1 + step * 0.001)
    assert len(sent) == 9  # one all-gather every 2 steps
    assert sent[0] == (0.101 + 0.102) / 2  # the window's mean own time
    # The streak broke at the third window; then 6 slow ones: reports at 3 and 6 in a row.
    assert [(s.rank, s.node, s.step, s.windows) for s in found] == [(2, "b", 12, 3),
                                                                   (2, "b", 18, 6)]
    assert found[0].seconds == 0.4 and found[0].reference == 0.1


def test_nothing_is_gathered_or_reported_when_turned_off_or_alone():
    w, sent = watch([])
    w.interval = 0
    assert all(w.after_step(s, 1.0) == [] for s in range(1, 10)) and sent == []
    w, sent = watch([])
    w.world_size = 1
    assert all(w.after_step(s, 1.0) == [] for s in range(1, 10)) and sent == []


def test_report_writes_one_event_per_straggler_and_a_log_line(caplog):
    events = []
    s = straggler.Straggler(rank=2, node="b", seconds=0.4, reference=0.1, windows=3, step=12)
    straggler.report([s], lambda kind, **f: events.append((kind, f)))
    assert events == [("straggler", {"rank": 2, "node": "b", "seconds": 0.4, "reference": 0.1,
                                     "windows": 3, "step": 12})]
    assert "straggler: rank 2 on b" in caplog.text and "4.0x the other ranks' 0.100s" in caplog.text
