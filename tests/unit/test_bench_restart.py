"""bench restart's pure parts: SLURM's requeue delay read from a job record, the model that
makes a state of a given size, and bad input as one line."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY, pyrecover

from pyrecover.bench.restart import model_for_state
from pyrecover.model import GPT, GPTConfig
from pyrecover.slurm.query import requeue_delay

# What `scontrol show job -o` said on the local cluster (SLURM 22.05) around a requeue.
BEFORE = {"JobState": "RUNNING", "Restarts": "0", "SubmitTime": "2026-11-24T04:51:43",
          "StartTime": "2026-11-24T04:51:44"}
HELD = {"JobState": "PENDING", "Restarts": "1", "SubmitTime": "2026-11-24T04:51:46",
        "StartTime": "2026-11-24T04:51:57"}
AFTER = {**HELD, "JobState": "RUNNING"}


def test_the_requeue_delay_is_from_the_requeue_to_the_next_attempts_start():
    assert requeue_delay(AFTER) == 11.0
    assert requeue_delay(BEFORE) is None  # never requeued: SubmitTime is the submission
    assert requeue_delay(HELD) is None  # StartTime is only SLURM's plan while pending
    assert requeue_delay({**AFTER, "StartTime": "Unknown"}) is None


@pytest.mark.parametrize("gb", [0.1, 1.0, 4.0])
def test_state_gb_gives_a_model_whose_weights_and_adamw_state_come_to_about_that(gb):
    sets = dict(s.split("=") for s in model_for_state(gb))
    cfg = GPTConfig(**{k.split(".")[1]: int(v) for k, v in sets.items()})
    with torch.device("meta"):
        params = GPT(cfg).num_params()
    assert 0.8 * gb * 1e9 <= 12 * params <= 1.1 * gb * 1e9, params


@pytest.mark.parametrize("args, message", [
    (["--interrupt", "nope"], "error: --interrupt must be one of signal, crash (got nope)"),
    (["--interrupt", "signal", "--interrupt", "kill"],
     "error: --interrupt must be one of signal, crash (got kill)"),
    (["--repeat", "0"], "error: --repeat must be >= 1 (got 0)"),
    (["--state-gb", "-1"], "--state-gb must be in (0, 64]"),
    (["--timeout", "0"], "--timeout must be a number of seconds > 0"),
    (["--timeout", "nan"], "'--timeout': nan is not a finite number"),
])
def test_bad_input_is_one_line_and_exit_2_before_anything_is_submitted(tmp_path, args,
                                                                       message):
    done = pyrecover("bench", "restart", "--dir", str(tmp_path / "store"), *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "store").exists()


def test_a_launch_that_fails_is_one_line_with_launchs_own_reason(tmp_path):
    """No cluster profile anywhere (HOME is empty): launch refuses before submitting. The
    --dir the bench made for the job stayed behind, empty."""
    done = pyrecover("bench", "restart", "--dir", str(tmp_path / "store" / "bench"),
                     env={"HOME": str(tmp_path)}, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: pyrecover launch failed: no cluster "
                                                   "profile"), lines
    assert not (tmp_path / "store").exists()


def test_a_local_world_size_the_global_batch_does_not_split_over_is_refused_at_once(
        tmp_path, corpus):
    """`--local --nproc 3` with tiny.yaml's global batch of 8 started the trainer, which
    refused it; the bench then said so, with a run directory of one log left in --dir."""
    done = pyrecover("bench", "restart", "--local", "--nproc", "3", "--dir",
                     str(tmp_path / "store"), "--config", str(TINY), "--set",
                     f"data.path={corpus}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: train.global_batch_size=8 is not allowed: expected a multiple of world size x "
        "train.micro_batch_size (3 x 2 = 6), or auto:8")
    assert not (tmp_path / "store").exists()


def test_a_restart_inside_the_allocation_counts_no_requeue_delay(tmp_path):
    """With --spare-nodes a crash restarts in the same job: the next attempt carries the same
    SLURM restart count, so the whole gap is pyrecover's own (no SLURM record is awaited)."""
    import time

    from pyrecover.bench import restart
    from pyrecover.rundir import RunDir, append_jsonl

    run = RunDir(tmp_path / "run")
    run.create()
    soon = time.time() + 5  # the resumed attempt's records, as the bench will find them
    for attempt, (begin, first) in enumerate([(soon - 60, soon - 50), (soon, soon + 3)]):
        for phase, at in (("process_start", begin), ("first_step", first)):
            append_jsonl(run.events, {"event": "phase", "time": at, "phase": phase, "job_id": "7",
                              "restart_count": 0, "in_job_restart": attempt})
    cycle = restart.interrupt(restart.Waiter("7", run, timeout=30), "crash", 0)
    assert cycle["requeue_delay_s"] == 0.0
    assert cycle["rest_s"] == cycle["total_s"] > 0
    assert (tmp_path / "run" / restart.KILL_FILE).exists()  # the crash was asked for
