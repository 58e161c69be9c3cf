"""Submitting a job: the only place that runs `sbatch`.

`sbatch_argv` builds the command (so `--dry-run` can show it); `submit` runs it. sbatch runs
with this process's environment, which SLURM exports to the job by default: that is how
secrets (WANDB_API_KEY, ...) reach the tasks without being written into the script.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from pyrecover.slurm import LaunchError, SlurmUnavailable


def sbatch_argv(script_path: str | Path) -> list[str]:
    """sbatch_argv is the command that submits `script_path` and prints only the job id."""
    return ["sbatch", "--parsable", str(script_path)]


def require_sbatch(environ: Mapping[str, str]) -> None:
    """require_sbatch raises LaunchError unless `sbatch` is on the PATH of `environ`."""
    if shutil.which("sbatch", path=environ.get("PATH", "")) is None:
        raise LaunchError("sbatch not found on PATH: launch from a SLURM login node, or use "
                          "--dry-run to print the job script and the sbatch command")


class MaybeSubmitted(SlurmUnavailable):
    """sbatch did not answer in time: the job may or may not be in the queue."""


# What sbatch says where SLURM, not the job, is the problem (SLURM's own error strings): the
# controller was never reached (nothing submitted), or its answer was lost (maybe submitted).
NOT_REACHED = ("Unable to contact slurm controller (connect failure)",
               "Unable to contact slurm controller (send failure)",
               "Unable to process configuration file")
ANSWER_LOST = ("Unable to contact slurm controller", "Socket timed out on send/recv operation")


TIMEOUT_ENV = "PYRECOVER_SBATCH_TIMEOUT"  # seconds sbatch may take to answer (default 120)


def made_for(folder: Path) -> Path | None:
    """made_for is the highest folder that writing `folder` will create (itself, or the
    storage folder above it too), or None where it exists: what a refused submission (or a
    benchmark, bench/common.py) removes, so that it leaves nothing behind."""
    missing = None
    for path in (folder, *folder.parents):
        if path.exists():
            return missing
        missing = path
    return missing


def sbatch_timeout(environ: Mapping[str, str]) -> float:
    """sbatch_timeout is $PYRECOVER_SBATCH_TIMEOUT (seconds, > 0), else 120."""
    text = environ.get(TIMEOUT_ENV, "")
    try:
        value = float(text) if text else 120.0
    except ValueError:
        value = -1.0
    if not 0 < value < 86400:
        raise LaunchError(f"{TIMEOUT_ENV}={text!r}: expected seconds, e.g. 300")
    return value


def submit(argv: list[str], cwd: str | Path | None = None, timeout: float = 120.0) -> int:
    """submit runs `argv` (from sbatch_argv) and returns the job id sbatch printed."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    except FileNotFoundError:
        raise LaunchError(f"{argv[0]} not found on PATH; use --dry-run to see the script") \
            from None
    except subprocess.TimeoutExpired:
        raise MaybeSubmitted(f"{argv[0]} did not answer within {timeout:.0f}s; the job may or "
                             "may not have been submitted: check with squeue") from None
    if result.returncode != 0:
        why = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
        if any(said in why for said in NOT_REACHED):
            raise SlurmUnavailable(f"{argv[0]} could not reach SLURM, so nothing was submitted: "
                                   f"{why}; try again once SLURM answers (`sinfo`)")
        if any(said in why for said in ANSWER_LOST):
            raise MaybeSubmitted(f"{argv[0]} got no answer from SLURM: {why}; the job may or "
                                 "may not have been submitted: check with squeue")
        raise LaunchError(f"{argv[0]} refused the job: {why}")
    return parse_job_id(result.stdout)


def parse_job_id(stdout: str) -> int:
    """parse_job_id reads `--parsable` output: `123` or `123;cluster`, maybe after warnings."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    head = lines[-1].split(";")[0] if lines else ""
    if not head.isdigit():
        raise LaunchError(f"could not read a job id from sbatch's output {stdout!r}")
    return int(head)
