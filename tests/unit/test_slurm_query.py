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
        f"103|COMPLETING|{script}",  # ending, or being requeued
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
    # launch's question: a job being requeued is COMPLETING too, and runs again
    assert ("103", "COMPLETING") in query.parse_queued(text, script, ending=True)
    assert query.parse_queued("", script) == []


def test_no_squeue_is_no_answer_not_an_empty_queue(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no squeue on it
    assert query.queued_jobs(tmp_path / "job.sbatch") is None


def test_status_names_the_slurm_command_it_waits_for_not_a_python_function(
        monkeypatch, tmp_path: Path):
    """With the controller down, status said `waiting for SLURM (squeue_state) to answer` and
    `(queued_jobs)`: names of pyrecover's functions, where launch says `(sbatch)`."""
    import contextlib

    from typer.testing import CliRunner

    from pyrecover.cli import app
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0, job_id="7", restart_count=0)
    (run.root / "job.sbatch").write_text("#!/bin/bash\n")
    said = []

    @contextlib.contextmanager
    def note(what, after_s=3.0):
        said.append(what)
        yield

    monkeypatch.setattr(query, "slow_note", note)
    monkeypatch.setattr(query, "squeue_state", lambda job: "PENDING")
    monkeypatch.setattr(query, "pending_reason", lambda job: "Priority")
    monkeypatch.setattr(query, "queued_jobs", lambda script: [])
    monkeypatch.setattr(query, "job_times", lambda job: [])
    result = CliRunner().invoke(app, ["status", str(run.root)])
    assert result.exit_code == 0, result.output
    assert said and set(said) <= {"squeue", "sacct", "scontrol"}, said
