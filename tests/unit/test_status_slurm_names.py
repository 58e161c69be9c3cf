"""`pyrecover status` names every SLURM job as SLURM itself does, so that what a person reads
can be given to `scancel`, `sacct` or `squeue -j`: a sweep trial's array task is
ARRAYID_TASKID, not the SLURM_JOB_ID its trainer and job script saw."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pyrecover import status, status_text
from pyrecover.rundir import RunDir


@pytest.fixture
def array_task_env(monkeypatch):
    """The environment SLURM gives task 1 of job array 40, whose own job id is 41."""
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "40")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")


def _requeue_by_the_job_script(run: RunDir, at: float) -> None:
    """The record the job script's `record` writes (slurm/blocks.py): SLURM_JOB_ID only."""
    with run.events.open("a") as f:
        f.write(json.dumps({"event": "requeue", "time": at, "job_id": "41",
                            "restart_count": 0, "in_job_restart": 0, "exit_code": 75,
                            "reason": "stopped cleanly"}) + "\n")


def test_an_array_task_is_shown_as_arrayid_taskid_not_its_own_job_id(tmp_path, array_task_env):
    """Status read 'SLURM job 41: PENDING' and 'requeue job 41' for task 40_1; `sacct -j 41`
    answers, but a person looking for the trial in `squeue` sees 40_1 and nothing named 41."""
    run = RunDir(tmp_path / "trial-1")
    run.create()
    run.event("phase", phase="process_start", time=1.0)
    run.event("start", step=0, time=2.0)
    run.event("stop", step=5, reason="signal", time=8.0)
    _requeue_by_the_job_script(run, 9.0)
    asked: list[str] = []

    def squeue(name: str) -> str:
        asked.append(name)
        return "PENDING"

    s = status.read(run.root, now=10.0, squeue=squeue)
    assert s.job_id == "40_1" and asked == ["40_1"]
    shown = status_text.render(s)
    assert "; SLURM job 40_1: PENDING\n" in shown
    assert "requeue     job 40_1 restart 0: exit 75 -> requeue (stopped cleanly)" in shown
    assert "41" not in shown.replace(str(run.root), "")
    assert status.read(run.root, now=10.0).job_id == "40_1"  # SLURM not asked: the same name


def test_a_cancelled_job_that_never_started_the_run_is_not_shown_as_its_job(
        tmp_path, monkeypatch):
    """`pyrecover cancel` of a run whose job 100 trains and whose relaunch 200 waits in the
    queue records a cancel of each, 200's last. Status then read 'SLURM job 200: CANCELLED'
    while job 100 was still saving its checkpoint, and `pyrecover cancel` again said job
    200 had nothing to cancel: the newest job came from any record, the cancel's too."""
    run = RunDir(tmp_path / "exp")
    run.create()
    monkeypatch.setenv("SLURM_JOB_ID", "100")
    run.event("start", step=0, time=2.0)
    monkeypatch.delenv("SLURM_JOB_ID")  # `pyrecover cancel` runs on the login node
    run.event("cancel", job_id="100", slurm_state="RUNNING", time=5.0)
    run.event("cancel", job_id="200", slurm_state="PENDING", time=5.1)
    slurm = {"100": "COMPLETING", "200": "CANCELLED"}
    s = status.read(run.root, now=6.0, squeue=slurm.get)
    assert (s.job_id, s.slurm_state) == ("100", "COMPLETING")
    assert status.slurm_job(run.root) == "100"


def test_a_run_whose_only_job_was_cancelled_in_the_queue_still_names_it(tmp_path):
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("cancel", job_id="200", slurm_state="PENDING", time=5.0)
    s = status.read(run.root, now=6.0, squeue={"200": "CANCELLED"}.get)
    assert (s.job_id, s.slurm_state, s.state) == ("200", "CANCELLED", "cancelled")


def test_a_running_trainers_job_is_named_once_on_the_state_line(tmp_path, monkeypatch):
    """The state of a live trainer names its job (the run's lock holder), and the SLURM part
    named it again: 'running (host vm, pid 4515, SLURM job 57); SLURM job 57: RUNNING'."""
    monkeypatch.setenv("SLURM_JOB_ID", "57")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    run = RunDir(tmp_path / "run")
    run.create()
    run.event("start", step=0, time=2.0)
    s = status.read(run.root, now=10.0, squeue=lambda name: "RUNNING")
    assert s.job_id == "57"
    live = dataclasses.replace(s, state="running (host n1, pid 7, SLURM job 57)")
    line = next(x for x in status_text.render(live).splitlines() if x.startswith("state"))
    assert line == "state       running (host n1, pid 7, SLURM job 57); SLURM: RUNNING"
    line = next(x for x in status_text.render(s).splitlines() if x.startswith("state"))
    assert line.endswith("; SLURM job 57: RUNNING")
