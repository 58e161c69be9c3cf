"""The start-up log's SLURM line: the job's time limit, or the time left where SLURM gives no
start and end (22.05: the job script passes the end it asked squeue for)."""

from __future__ import annotations

from pyrecover import system

JOB = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_JOB_PARTITION": "p"}


def test_the_time_limit_comes_from_slurm_s_start_and_end():
    info = system.slurm_job({**JOB, "SLURM_JOB_START_TIME": "1000", "SLURM_JOB_END_TIME": "4600"})
    assert info["slurm_time_limit"] == "1:00:00"


def test_without_slurm_s_times_the_job_script_s_end_gives_the_time_left():
    info = system.slurm_job({**JOB, "PYRECOVER_JOB_END_TIME": "2000"}, now=1250.0)
    assert info["slurm_time_left"] == "0:12:30" and "slurm_time_limit" not in info


def test_with_neither_the_time_limit_is_unknown_and_outside_slurm_there_is_no_job():
    assert "slurm_time_left" not in system.slurm_job(JOB)
    assert "slurm_time_limit" not in system.slurm_job(JOB)
    assert system.slurm_job({}) == {}
