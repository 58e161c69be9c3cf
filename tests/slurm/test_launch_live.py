"""`pyrecover launch` finds a run's job while SLURM requeues it, on a real local SLURM.

A pyrecover job script requeues its job (`scontrol requeue`) after a stop or a crash; SLURM
then ends the job's processes, and until they are gone squeue says COMPLETING. That job runs
again a little later: a second job launched for the run meanwhile would be a second job of
the run, rewriting run.yaml under the first.
"""

from __future__ import annotations

import time

import pytest
from localslurm import LocalSlurm

from pyrecover.cli.launch import _refuse_live
from pyrecover.rundir import RunDir
from pyrecover.slurm import LaunchError, query

pytestmark = pytest.mark.slurm

# Requeues itself on its first run, as a job script does after a stop; it ignores SIGTERM,
# so SLURM takes its KillWait (5 s here) to end it: COMPLETING all that while.
REQUEUES = """#!/bin/bash
trap '' TERM
if [ -z "${SLURM_RESTART_COUNT:-}" ]; then
    scontrol requeue "$SLURM_JOB_ID"
fi
sleep 300
"""


def wait_state(script, state: str, timeout: float = 60.0) -> str:
    """wait_state is the id of the job squeue lists in `state` for `script`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        jobs = [job for job, said in query.queued_jobs(script, ending=True) or []
                if said == state]
        if jobs:
            return jobs[0]
        time.sleep(0.05)
    raise TimeoutError(f"no job of {script} became {state} in {timeout}s")


def test_a_run_whose_job_requeues_itself_is_not_launched_again_while_it_is_completing(
        local_slurm: LocalSlurm, jobs, tmp_path, monkeypatch):
    for name, value in local_slurm.client_env().items():
        monkeypatch.setenv(name, value)
    run = RunDir(tmp_path / "run")
    run.create()
    run.job_script.write_text(REQUEUES)
    job_id = local_slurm.run("sbatch", "--parsable", "--requeue", "-o",
                             str(tmp_path / "job.out"), str(run.job_script)).stdout.strip()
    jobs.append(int(job_id))
    assert wait_state(run.job_script, "COMPLETING") == job_id
    with pytest.raises(LaunchError) as refused:
        _refuse_live(run)
    assert str(refused.value) == (
        f"run {run.root} already has SLURM job {job_id} (COMPLETING): it is ending, or being "
        "requeued to run again; launch again once `squeue --me` no longer lists it")
    # and the job does run again: a second job launched meanwhile would have been beside it
    assert wait_state(run.job_script, "RUNNING") == job_id
