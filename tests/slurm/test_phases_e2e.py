"""Where the seconds of an interruption go, on a real local SLURM cluster (2 tasks, USR2).

The events of the interruption hold every stop and start phase in order, `status --json`
reports them, and the goodput ledger's causes add up to the run's wall time.
"""

from __future__ import annotations

import time

import pytest
from test_requeue_e2e import (
    MAX_STEPS,
    events,
    explain,
    launch,
    status,
    wait_end,
    wait_running_at_step,
)

from pyrecover.ledger import CAUSES
from pyrecover.phases import START_PHASES, STOP_PHASES

pytestmark = pytest.mark.slurm


@pytest.fixture
def jobs(local_slurm):
    """Job ids to cancel when the test ends, so a failed test leaves nothing running."""
    ids: list[int] = []
    yield ids
    for job_id in ids:
        local_slurm.cancel(str(job_id))


def test_a_stopped_and_resumed_job_records_every_phase_in_order_and_its_ledger_adds_up(
        local_slurm, jobs, corpus, tmp_path):
    submitted = time.time()
    job_id, run_dir = launch(local_slurm, jobs, tmp_path, "phases", corpus,
                             env={"PYRECOVER_STEP_DELAY": "1"})
    wait_running_at_step(local_slurm, job_id, run_dir, 4)
    local_slurm.run("scancel", "--signal=USR2", str(job_id))
    info = wait_end(local_slurm, job_id, run_dir, timeout=300)
    ended = time.time()
    assert (info["JobState"], info["Restarts"]) == ("COMPLETED", "1"), explain(run_dir, job_id)

    # Two attempts, each with every start phase (a resume also restores), in order.
    phases = [e for e in events(run_dir) if e["event"] == "phase"]
    starts = [i for i, e in enumerate(phases) if e["phase"] == "process_start"]
    assert len(starts) == 2, explain(run_dir, job_id)
    first, second = phases[:starts[1]], phases[starts[1]:]
    fresh = [p for p in START_PHASES if p != "restored"]  # nothing to restore at step 0
    assert [e["phase"] for e in first] == fresh + list(STOP_PHASES), explain(run_dir, job_id)
    assert [e["phase"] for e in second] == list(START_PHASES) + ["exit"]
    for attempt in (first, second):
        by_phase = {e["phase"]: e["time"] for e in attempt}
        order = [p for p in START_PHASES + STOP_PHASES if p in by_phase]
        times = [by_phase[p] for p in order]
        assert times == sorted(times), list(zip(order, times, strict=True))
    assert first[-1]["phase"] == "exit" and first[-1]["time"] <= second[0]["time"]

    # status --json: the interruption, phase by phase, and the ledger.
    report = status(local_slurm, run_dir)
    rows = report["interruption"]
    assert [r["phase"] for r in rows] == list(STOP_PHASES) + list(START_PHASES)
    assert all(r["gap"] >= 0 for r in rows), rows
    assert rows[0]["time"] < rows[-1]["time"] < ended
    book = report["ledger"]
    assert set(book["causes"]) == set(CAUSES)
    assert abs(sum(book["causes"].values()) - book["wall_seconds"]) <= 1.0, book
    first_record = min(e["time"] for e in events(run_dir))
    last_record = max(e["time"] for e in events(run_dir))
    assert abs(book["wall_seconds"] - (last_record - first_record)) <= 1.0, book
    assert book["wall_seconds"] <= ended - submitted
    # Each step is delayed 1 s, so most of a run of MAX_STEPS steps is productive training.
    assert book["causes"]["productive"] >= MAX_STEPS * 0.5, book
    assert book["causes"]["restore"] > 0 and book["causes"]["start_up"] > 0
    assert book["causes"]["lost_work"] == 0  # the stop saved its own step
    assert 0 < book["effective_share"] < 1
