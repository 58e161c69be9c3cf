"""`pyrecover bench restart --local`: the restart benchmark without SLURM, as a user runs it
(the CLI, 2 real local workers, a real USR2 and a real SIGKILL), with its smallest settings.

What is checked is that the report adds up and that the run it leaves behind is sound, never
how fast anything was.
"""

from __future__ import annotations

import json

import pytest
from helpers import check_restart_cycles, pyrecover, tiny_args

pytestmark = pytest.mark.multiproc

SETS = ("model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
        "train.global_batch_size=8", "train.micro_batch_size=2", "checkpoint.interval=5",
        "train.device=cpu")


def test_a_local_signal_and_crash_are_timed_phase_by_phase_and_the_run_stays_sound(
        tmp_path, corpus):
    sets = tiny_args(tmp_path, corpus, "unused", *SETS)  # the bench names the run itself
    done = pyrecover("bench", "restart", "--local", "--nproc", "2", "--dir", str(tmp_path),
                     "--repeat", "1", "--timeout", "300", "--json", *sets, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    assert report["world_size"] == 2 and report["launcher"] == "local"
    check_restart_cycles(report)
    for cycle in report["cycles"]:
        # No SLURM, no queue: the whole interruption is the rest the issue bounds.
        assert cycle["requeue_delay_s"] == 0 and cycle["rest_s"] == cycle["total_s"]
    # The bench restarted a stop (75) and a crash (a killed worker: 137, or its peer's 1),
    # then ended the run with SIGTERM, which the trainer takes as a stop: it saved.
    codes = report["exit_codes"]
    assert codes[0] == 75 and codes[1] in (1, 137) and codes[-1] == 75, codes
    for kind in ("signal", "crash"):
        assert report["summary"][kind]["runs"] == 1
        assert report["summary"][kind]["figures"]["rest_s"]["median"] > 0
    verify = pyrecover("ckpt", "verify", report["run_dir"])
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("extra, says", [
    (["--local", "--nodes", "2"], "--nodes: for a SLURM job; --local runs without one"),
    (["--nproc", "2"], "--nproc is for --local"),
    (["--local", "--nproc", "0"], "--nproc must be >= 1 (got 0)"),
    (["--local", "--set", "train.nonsense=1"], "train.nonsense"),
    (["--local", "--repeat", "0"], "error: --repeat must be >= 1 (got 0)"),
    (["--local", "--set", "data.path=missing.parquet"], "'missing.parquet' does not exist"),
])
def test_bench_restart_refuses_what_cannot_run_in_one_line(tmp_path, extra, says):
    done = pyrecover("bench", "restart", "--dir", str(tmp_path), *extra)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and says in done.stderr, done.stderr
    assert not list(tmp_path.glob("bench-restart-*"))  # nothing started
