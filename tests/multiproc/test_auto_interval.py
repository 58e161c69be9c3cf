"""`checkpoint.interval: auto` at world size 2: every rank saves at the steps rank 0 chose."""

from __future__ import annotations

import pytest
from helpers import pyrecover, tiny_args

from pyrecover.checkpoint.interval import FIRST_STEPS
from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("mode", ["vanilla", "dcp"])  # dcp: asynchronous, committed steps later
def test_an_auto_interval_is_chosen_after_the_first_save_and_every_save_follows_it(tmp_path,
                                                                                    corpus, mode):
    # A prior MTBF of 36 s makes the rule ask for saves every MIN_SECONDS (10 s) of steps.
    done = pyrecover("train", "--nproc", "2", *tiny_args(
        tmp_path, corpus, "run", "train.max_steps=60", "checkpoint.interval=auto",
        "checkpoint.mtbf_hours=0.01", f"checkpoint.mode={mode}"))
    assert done.returncode == 0, done.stderr
    events = list(read_jsonl(tmp_path / "run" / "events.jsonl"))
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    changes = [e for e in events if e["event"] == "checkpoint_interval"]
    # The first save comes FIRST_STEPS after the first step, to measure a save.
    assert saved[0] == 1 + FIRST_STEPS
    assert changes and changes[0]["step"] == saved[0], events
    assert changes[0]["mtbf_hours"] == pytest.approx(0.01)
    # The rule's stall is the first save's own `blocked`: every wait of the loop for it, its
    # commit at a step boundary included (that one once left out a third of a vanilla save).
    first = next(e for e in events if e["event"] == "checkpoint")
    assert changes[0]["stall_seconds"] == first["blocked"] > 0
    assert "checkpoint interval 20 -> " in done.stderr
    # Every later save is the chosen interval after the one before it (or the last step).
    interval = {c["step"]: c["interval"] for c in changes}
    current = FIRST_STEPS
    for before, after in zip(saved, saved[1:], strict=False):
        current = interval.get(before, current)
        assert after - before == current or after == 60, (saved, changes)
    assert saved[-1] == 60
