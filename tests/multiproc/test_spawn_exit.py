"""`pyrecover train --nproc N` (what each node's task runs under `--launcher spawn`) ends
like its workers: a killed worker is a crash code (its own 128 + 9 as the shell shows it,
or the survivor's 1 when that one is seen first), so the job script requeues it as a crash,
not as a clean stop."""

from __future__ import annotations

import pytest
from helpers import pyrecover, tiny_args

from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc


def test_a_killed_worker_ends_the_task_with_a_crash_code_and_no_stop(tmp_path, corpus):
    done = pyrecover("train", "--nproc", "2", *tiny_args(tmp_path, corpus, "crash"), env={
        "PYRECOVER_KILL_AT_STEP": "3", "PYRECOVER_KILL_RANK": "1",
        "PYRECOVER_KILL_TARGET": "self"})
    assert done.returncode in (1, 128 + 9), done.stderr[-3000:]
    # The dead rank is named; its peer's own error only says the connection closed.
    assert "pyrecover: rank 1 (pid " in done.stderr and ") was killed by SIGKILL" in done.stderr
    kinds = [e["event"] for e in read_jsonl(tmp_path / "crash" / "events.jsonl")]
    assert "stop" not in kinds and "finish" not in kinds


def test_more_workers_than_gpus_on_cuda_is_one_line_before_any_worker_starts(tmp_path, corpus):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU for each of the 2 workers")
    done = pyrecover("train", "--nproc", "2",
                     *tiny_args(tmp_path, corpus, "gpus", "train.device=cuda"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().count("\n") == 0, done.stderr
    assert "2 processes on this machine need 2 GPUs" in done.stderr
    assert "--set train.device=cpu" in done.stderr
    assert not (tmp_path / "gpus" / "events.jsonl").exists()  # no worker started
