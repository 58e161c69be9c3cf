"""Reading squeue's answers (pyrecover/slurm/query.py): which queued jobs are a run's own."""

from __future__ import annotations

import os
from pathlib import Path

from pyrecover.slurm import query


def test_a_run_s_queued_jobs_are_the_live_ones_that_run_its_own_script(tmp_path: Path):
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    script = run / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    other = tmp_path / "runs" / "b" / "job.sbatch"
    os.symlink(tmp_path / "runs", tmp_path / "link")  # the same file by another path
    text = "\n".join([
        f"101|PENDING|{script}",
        f"102|RUNNING|{tmp_path / 'link' / 'a' / 'job.sbatch'}",
        f"103|COMPLETING|{script}",  # ending: a new job waits for its lock, no more
        f"104|REQUEUE_HOLD|{script}",
        f"105|RUNNING|{other}",
        f"106_3|RUNNING|{script}",  # an array task's id
        f"107|CANCELLED|{script}",
        "not a line of squeue's",
        f"108|PENDING|{script} with | a bar in its name",
    ])
    assert query.parse_queued(text, script) == [
        ("101", "PENDING"), ("102", "RUNNING"), ("104", "REQUEUE_HOLD"), ("106_3", "RUNNING")]
    assert query.parse_queued(text, other) == [("105", "RUNNING")]
    assert query.parse_queued("", script) == []


def test_no_squeue_is_no_answer_not_an_empty_queue(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue on it
    assert query.queued_jobs(tmp_path / "job.sbatch") is None
