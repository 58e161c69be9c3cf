"""Asking SLURM about a job: `squeue`, then `scontrol` for jobs squeue no longer lists."""

from __future__ import annotations

import subprocess


def squeue_state(job_id: str) -> str | None:
    """squeue_state asks SLURM for a job's state; None when SLURM does not know or answer."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    state = out.stdout.strip()
    if out.returncode == 0 and state:
        return state
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    for field_ in out.stdout.split():
        if field_.startswith("JobState="):
            return field_.split("=", 1)[1]
    return None


def sinfo(fmt: str) -> str | None:
    """sinfo asks SLURM for its partitions in `fmt`; None when SLURM does not answer."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", fmt], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None
