"""A hung rank is found by its watchdog, reported, persisted and resumed from; a slow first
step or a slow save that keeps writing is not a hang; a slow rank is reported as a straggler.

Real `pyrecover train --nproc 2` runs (gloo); the hang, the stall and the slow rank come from
the fault hooks in pyrecover/faults.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import events, load_export, pyrecover, tiny_args

from pyrecover.preempt import EXIT_HANG
from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc

MEMORY = ("checkpoint.mode=memory", "checkpoint.snapshot_interval=1", "checkpoint.interval=100",
          "train.max_steps=12")
# The short normal-step limit goes to the run meant to hang only, and is still far above any
# normal phase on a busy machine; the runs that must not hang keep the default (`auto`).
HANG_LIMIT = 10
WATCH = (f"run.hang_timeout={HANG_LIMIT}", "run.hang_startup_timeout=60")


def train(storage: Path, corpus: Path, name: str, *extra: str, env=None):
    return pyrecover("train", "--nproc", "2", *tiny_args(storage, corpus, name, *extra),
                     env=env)


def export(run_dir: Path) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    done = pyrecover("ckpt", "export", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    return load_export(out)


def test_a_hung_rank_fires_its_watchdog_persists_and_the_restart_resumes_bit_for_bit(
        tmp_path, corpus):
    ref = train(tmp_path, corpus, "ref", *MEMORY)
    assert ref.returncode == 0, ref.stderr

    hang = {"PYRECOVER_HANG_AT_STEP": "7", "PYRECOVER_HANG_RANK": "1",
            "PYRECOVER_HANG_PHASE": "forward"}
    hung = train(tmp_path, corpus, "run", *MEMORY, *WATCH, env=hang)
    run_dir = tmp_path / "run"
    assert hung.returncode == EXIT_HANG, hung.stderr
    (event,) = [e for e in events(run_dir, "hang") if e["rank"] == 1]
    assert (event["phase"], event["step"], event["limit"]) == ("forward", 7, HANG_LIMIT)
    assert event["node"] and "maybe_hang" in event["stacks"]
    assert "HANG on rank 1" in hung.stderr and "thread MainThread" in hung.stderr
    # Found after the timeout and long before torch's own (600 s), from the last step logged
    # before it to the event; the slack is for a busy machine, not a speed claim.
    last_step = max(m["time"] for m in read_jsonl(run_dir / "metrics.jsonl"))
    assert HANG_LIMIT <= event["seconds"] and event["time"] - last_step < 60
    assert {e["rank"] for e in events(run_dir, "snapshot_persisted")} == {0, 1}

    resumed = train(tmp_path, corpus, "run", *MEMORY)
    assert resumed.returncode == 0, resumed.stderr
    (resume,) = events(run_dir, "resume")
    assert resume["step"] == 6  # the newest snapshot: at most one snapshot interval back
    assert events(run_dir, "snapshot_recovered")[0]["step"] == 6
    ref_model, model = export(tmp_path / "ref"), export(run_dir)
    for key in ref_model:
        assert torch.equal(ref_model[key], model[key]), key

    status = pyrecover("status", str(run_dir))
    assert "restarts 1 x hang" in status.stdout
    assert "hang        rank 1 on" in status.stdout and "phase forward of step 7" in status.stdout


def test_a_slow_first_step_and_a_slow_save_that_keeps_writing_do_not_fire(tmp_path, corpus):
    run_dir = tmp_path / "slow"
    # The first step stalls 15 s, past hang_timeout=10 (a normal step's limit, far above any
    # normal phase on a busy machine): its limit is the startup one.
    stall = {"PYRECOVER_HANG_AT_STEP": "1", "PYRECOVER_HANG_RANK": "0,1",
             "PYRECOVER_HANG_PHASE": "forward", "PYRECOVER_HANG_FOR": "15"}
    first = train(tmp_path, corpus, "slow", "run.hang_timeout=10", "run.hang_startup_timeout=60",
                  "train.max_steps=4", env=stall)
    assert first.returncode == 0, first.stderr
    assert "hangs in phase forward of step 1" in first.stderr
    # The save at step 10 stalls 18 s on rank 1 while it writes, rank 0 waiting for it: past
    # hang_startup_timeout=15, a save's limit. A normal step's limit (60) is kept out of reach.
    limits = ("run.hang_timeout=60", "run.hang_startup_timeout=15")
    save = {"PYRECOVER_HANG_AT_STEP": "10", "PYRECOVER_HANG_RANK": "1",
            "PYRECOVER_HANG_PHASE": "checkpoint", "PYRECOVER_HANG_FOR": "18",
            "PYRECOVER_HANG_WRITE_TO": str(run_dir / "checkpoints" / ".tmp-step-10-slow" / "x")}
    second = train(tmp_path, corpus, "slow", *limits, "train.max_steps=12", env=save)
    assert second.returncode == 0, second.stderr
    assert "hangs in phase checkpoint of step 10" in second.stderr
    assert not events(run_dir, "hang")
    assert events(run_dir, "finish")

    # The same stall without writing is a hang, on both ranks, at the save's limit: the
    # startup one (15), not a normal step's (60).
    del save["PYRECOVER_HANG_WRITE_TO"]
    save["PYRECOVER_HANG_AT_STEP"] = "20"
    third = train(tmp_path, corpus, "slow", *limits, "train.max_steps=24", env=save)
    assert third.returncode == EXIT_HANG, third.stderr
    assert {(e["phase"], e["step"], e["limit"]) for e in events(run_dir, "hang")} == {
        ("checkpoint", 20, 15)}


def test_a_slow_rank_is_reported_as_a_straggler_and_an_even_run_reports_none(tmp_path, corpus):
    extra = ("run.straggler_interval=4", "run.straggler_windows=2", "train.max_steps=16")
    slow = train(tmp_path, corpus, "slow", *extra,
                 env={"PYRECOVER_SLOW_RANK": "1", "PYRECOVER_SLOW_S": "0.1"})
    assert slow.returncode == 0, slow.stderr
    found = events(tmp_path / "slow", "straggler")
    assert [(e["rank"], e["step"], e["windows"]) for e in found] == [(1, 8, 2), (1, 16, 4)]
    assert found[0]["node"] and found[0]["seconds"] > 1.5 * found[0]["reference"]
    assert "straggler: rank 1 on" in slow.stderr
    status = pyrecover("status", str(tmp_path / "slow"))
    assert "straggler   rank 1 on" in status.stdout

    # Both ranks' own time is the same injected 0.1 s, so scheduling noise on a busy machine
    # cannot make either 1.5 x the other.
    even = train(tmp_path, corpus, "even", *extra,
                 env={"PYRECOVER_SLOW_RANK": "0,1", "PYRECOVER_SLOW_S": "0.1"})
    assert even.returncode == 0, even.stderr
    assert not events(tmp_path / "even", "straggler")


def test_under_fsdp_a_rank_waiting_on_a_stopped_peer_reports_a_collective_phase(tmp_path, corpus):
    """FSDP all-gathers in the forward: rank 0, waiting there for rank 1 (stopped in its data
    phase), reported a hang "in phase forward", which the job script took as its node's own
    fault. The phase is named fsdp_forward, no node is blamed by it, and the silent peer is
    named instead."""
    stop = {"PYRECOVER_HANG_AT_STEP": "5", "PYRECOVER_HANG_RANK": "1",
            "PYRECOVER_HANG_PHASE": "data", "PYRECOVER_HANG_HOW": "stop"}
    hung = train(tmp_path, corpus, "fsdp", "train.parallel=fsdp", "train.max_steps=8", *WATCH,
                 env=stop)
    assert hung.returncode == EXIT_HANG, hung.stderr[-3000:]
    [report] = [e for e in events(tmp_path / "fsdp", "hang") if e["rank"] == 0]
    assert (report["phase"], report["step"]) == ("fsdp_forward", 5)
    assert report["silent_ranks"] == [1]
    # A stopped rank persists nothing: the launcher ends it without the survivors' grace.
    assert "the ranks still running are stopped (SIGSTOP, state T); ending them now" in \
        hung.stderr
