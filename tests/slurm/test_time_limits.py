"""A `--time` pyrecover accepts is the limit the real sbatch gives the job: fields that
overflow carry into the next one and seconds round up to whole minutes, as scontrol shows;
one too long for SLURM is refused before anything is submitted."""

from __future__ import annotations

import pytest
from helpers import TINY, default_cluster, pyrecover

from pyrecover.slurm import profile

pytestmark = pytest.mark.slurm

TIMES = ["1-25", "0:75:00", "1-24:00:00", "90:00", "90:30", "0:0:30", "1-2:3:4", "0:00:00",
         "1-", "0-"]


def scontrol_seconds(shown: str) -> int | None:
    """The seconds of scontrol's TimeLimit (`D-HH:MM:SS`, `HH:MM:SS`, UNLIMITED)."""
    if shown == "UNLIMITED":
        return None
    days, _, clock = shown.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return int(days or 0) * 86400 + h * 3600 + m * 60 + s


def test_each_time_is_the_limit_sbatch_gives_the_job(local_slurm, jobs, tmp_path):
    for text in TIMES:
        # held: it never runs, so the test waits on nothing but sbatch and scontrol
        job_id = local_slurm.submit("#!/bin/bash\ntrue\n", "--hold", f"--time={text}", cwd=tmp_path)
        jobs.append(job_id)
        shown = local_slurm.job_info(job_id)["TimeLimit"]
        assert profile.time_seconds(text) == scontrol_seconds(shown), (text, shown)


def launch(tmp_path, *args: str):
    return pyrecover(
        "launch",
        "--config",
        str(TINY),
        "--set",
        f"run.storage={tmp_path / 'store'}",
        "--dry-run",
        *args,
        env=default_cluster(tmp_path),
        cwd=tmp_path,
    )


def test_a_limit_slurm_rounds_past_the_signal_is_launched(tmp_path):
    # SLURM makes 1:30 two minutes, so USR2 90 s before the end comes 30 s into the job
    done = launch(tmp_path, "--time", "1:30", "--signal-seconds", "90")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --time=1:30\n" in done.stdout and "#SBATCH --signal=USR2@90\n" in done.stdout


def test_a_limit_of_days_and_a_dash_is_launched_as_whole_days(tmp_path):
    # sbatch reads `--time=1-` as one day (TimeLimit=1-00:00:00); launch refused it
    done = launch(tmp_path, "--time", "1-", "--signal-seconds", "90")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --time=1-\n" in done.stdout


def test_a_limit_longer_than_slurm_keeps_is_one_line_before_anything_is_written(tmp_path):
    done = launch(tmp_path, "--time", "24855-03:13:09")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "error: time='24855-03:13:09' is not allowed: expected at most 24855 days, or infinite "
        "(cluster profile key time, option --time)"
    ]
    assert not (tmp_path / "store").exists()
