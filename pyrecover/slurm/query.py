"""Asking SLURM about a job: `squeue`, then `scontrol` for jobs squeue no longer lists."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from pyrecover.slurm import SlurmUnavailable

# States of a job that is queued or running (squeue's %T): such a job still starts a trainer.
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD",
               "REQUEUE_FED", "RESIZING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT")


@contextlib.contextmanager
def slow_note(what: str, after_s: float = 3.0) -> Iterator[None]:
    """slow_note says on stderr, once `after_s` seconds pass inside it, that a SLURM command
    has not answered yet: a controller that is down makes sbatch retry for a minute, and a
    silent command looks hung."""
    timer = threading.Timer(after_s, lambda: print(
        f"pyrecover: waiting for SLURM ({what}) to answer; `sinfo` tells whether its "
        "controller is up", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


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


def pending_reason(job_id: str) -> str | None:
    """pending_reason is squeue's reason a job waits (Resources, Priority, JobHeldUser,
    QOSMaxJobsPerUserLimit, ...); None when it gives none or does not answer."""
    reason = _answer(["squeue", "-h", "-j", job_id, "-o", "%r"]).strip()
    return reason if reason and reason != "None" else None


def array_states(array_id: str) -> dict[str, str]:
    """array_states maps each task of job array `array_id` that SLURM knows (named
    ARRAY_TASK, as `squeue -r` names it) to its state, in two calls whatever the number of
    tasks: scontrol for every task the controller still holds (a finished one for MinJobAge),
    then squeue for the queued and running ones, which it expands one per line. {} when SLURM
    does not answer."""
    states: dict[str, str] = {}
    for line in _answer(["scontrol", "show", "job", "-o", array_id]).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        task = fields.get("ArrayTaskId", "")
        if fields.get("ArrayJobId") == array_id and task.isdigit() and fields.get("JobState"):
            states[f"{array_id}_{task}"] = fields["JobState"]  # (pending ones: a range)
    for line in _answer(["squeue", "-h", "-r", "-j", array_id, "-o", "%i %T"]).splitlines():
        job, _, state = line.strip().partition(" ")
        if job.startswith(f"{array_id}_") and state:
            states[job] = state.strip()
    return states


def _answer(argv: list[str]) -> str:
    """_answer is what a SLURM command printed, "" when it failed or did not answer."""
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def sinfo(fmt: str) -> str | None:
    """sinfo asks SLURM for its partitions in `fmt`; None when SLURM does not answer."""
    try:
        out = subprocess.run(["sinfo", "-h", "-o", fmt], capture_output=True, text=True,
                             timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 and out.stdout.strip() else None


def parse_sacct_times(text: str) -> list[tuple[float, float, float | None]]:
    """parse_sacct_times reads `sacct -D -X -n -P -o Submit,Start,End` lines into (submit,
    start, end) epoch seconds, one per attempt of a requeued job; attempts that never
    started are left out, and an end of `Unknown` (still running) is None."""
    out = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 3:
            continue
        try:
            submit, start = (time.mktime(time.strptime(p, "%Y-%m-%dT%H:%M:%S"))
                             for p in parts[:2])
        except ValueError:
            continue
        try:
            end: float | None = time.mktime(time.strptime(parts[2], "%Y-%m-%dT%H:%M:%S"))
        except ValueError:
            end = None
        out.append((submit, start, end))
    return out


def job_times(job_id: str) -> list[tuple[float, float, float | None]]:
    """job_times asks `sacct` for every attempt of a job (requeues included); an empty list
    where accounting is off or SLURM does not answer."""
    try:
        out = subprocess.run(["sacct", "-D", "-X", "-n", "-P", "-j", job_id, "-o",
                              "Submit,Start,End"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_sacct_times(out.stdout) if out.returncode == 0 else []


def job_record(job_id: str) -> dict[str, str]:
    """job_record is `scontrol show job -o JOB` as a mapping (JobState, Restarts, SubmitTime,
    StartTime, ...); empty when SLURM does not know the job or does not answer."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if out.returncode != 0:
        return {}
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def slurm_time(text: str) -> float | None:
    """slurm_time reads one of SLURM's local times (2026-11-24T04:51:46) as epoch seconds;
    None for `Unknown`, `None` or anything else."""
    try:
        return time.mktime(time.strptime(text, "%Y-%m-%dT%H:%M:%S"))
    except (TypeError, ValueError):
        return None


def requeue_delay(record: dict[str, str]) -> float | None:
    """requeue_delay is how long SLURM held a requeued job before its latest attempt started,
    from `job_record`: a requeue sets the job's SubmitTime to the moment of the requeue (the
    previous attempt's end) and the attempt's StartTime is when it began. None before the
    first requeue or while the attempt has not started."""
    if record.get("Restarts", "0") in ("", "0") or record.get("JobState") == "PENDING":
        return None
    queued, started = slurm_time(record.get("SubmitTime", "")), slurm_time(
        record.get("StartTime", ""))
    return None if queued is None or started is None else started - queued


def signal_job(job_id: str, signal: str) -> None:
    """signal_job sends `signal` (USR2, TERM, ...) to every task of the job's steps, not to
    the batch shell (`scancel --signal`): what SLURM itself sends before a time limit."""
    subprocess.run(["scancel", f"--signal={signal}", job_id], check=True, capture_output=True,
                   timeout=30)


class Cancelled(NamedTuple):
    """What `cancel_job` got: `refused`, scancel's complaint (the job was not cancelled);
    `requeueable`, scontrol's complaint where scancel took a job that scontrol did not make
    non-requeueable (a running job script then requeues it)."""

    refused: str | None
    requeueable: str | None


def cancel_job(job_id: str) -> Cancelled:
    """cancel_job ends the job for good: a pyrecover job script takes scancel's SIGTERM for a
    preemption and requeues itself, so the job is made non-requeueable first (`scontrol
    update Requeue=0`), and made requeueable again where scancel refuses it. A job that
    already ended is no error to callers that ignore the answer. Raises SlurmUnavailable
    where scancel failed and SLURM no longer answers (its controller went away after the
    caller's squeue): a fault of the cluster, not a refusal of the job."""
    kept = _complaint(["scontrol", "update", f"JobId={job_id}", "Requeue=0"])
    refused = _complaint(["scancel", job_id])
    if refused is not None and not answers():
        raise SlurmUnavailable(f"SLURM did not answer while job {job_id} was being cancelled ("
                               f"{' '.join(refused.split())}): it may still be queued or "
                               "running; type the same command again once SLURM answers "
                               "(`sinfo`)")
    if refused is not None and kept is None:  # not cancelled: its requeues are its own
        undone = _not_changed(_complaint(["scontrol", "update", f"JobId={job_id}",
                                          "Requeue=1"]))
        if undone is not None:
            refused += (f"; and it is left non-requeueable (scontrol: {undone}): `scontrol "
                        f"update JobId={job_id} Requeue=1` makes it requeue itself again")
    return Cancelled(refused=refused,
                     requeueable=_not_changed(kept) if refused is None else None)


def answers() -> bool:
    """answers tells whether SLURM's controller answers a query (squeue of this user's
    jobs)."""
    try:
        return subprocess.run(["squeue", "-h", "--me", "-o", "%i"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _complaint(argv: list[str]) -> str | None:
    """_complaint is what the SLURM command `argv` said of a failure, None where it
    succeeded."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{argv[0]}: {exc}"
    return None if done.returncode == 0 else (done.stderr.strip() or
                                              f"{argv[0]} exited {done.returncode}")


# What scontrol update says per task of an array for a task it did not need to change.
UNCHANGED_OK = (": No error", ": Job has already finished")


def _not_changed(said: str | None) -> str | None:
    """_not_changed is scontrol update's complaint less its lines for array tasks that were
    changed or had already ended (no script of theirs is left to requeue them): an array
    with one task cancelled before exits 1 with `A_0-2: No error` and `A_3: Job has
    already finished`. None where nothing else is left."""
    rest = [line for line in (said or "").splitlines() if line.strip()
            and not line.rstrip().endswith(UNCHANGED_OK)]
    return "\n".join(rest) or None


def queued_jobs(script: str | Path, ending: bool = False) -> list[tuple[str, str]] | None:
    """queued_jobs is [(job id, state)] of this user's jobs that run the batch script
    `script` (squeue's %o, the absolute path sbatch recorded) and are queued or running: a
    run's own jobs, also those that never started and so left no event in the run directory.
    COMPLETING jobs are left out (they are ending) unless `ending`: one being requeued is
    COMPLETING too, and runs again. None when squeue does not answer."""
    text = my_jobs()
    return None if text is None else parse_queued(text, script, ending)


def my_jobs() -> str | None:
    """my_jobs is this user's live jobs as `squeue -h --me -o %i|%T|%o` prints them (id,
    state, batch script), one per line; None when squeue does not answer."""
    try:
        out = subprocess.run(["squeue", "-h", "--me", "-o", "%i|%T|%o"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def parse_states(text: str) -> dict[str, str]:
    """parse_states maps each job of `squeue -o %i|%T|%o` lines (my_jobs) to its state."""
    return {parts[0]: parts[1] for parts in (line.strip().split("|", 2)
                                             for line in text.splitlines()) if len(parts) == 3}


def parse_queued(text: str, script: str | Path, ending: bool = False) -> list[tuple[str, str]]:
    """parse_queued reads `squeue -o %i|%T|%o` lines: the live jobs whose script is `script`
    (COMPLETING ones too where `ending`)."""
    want = os.path.realpath(script)
    jobs = []
    for line in text.splitlines():
        parts = line.strip().split("|", 2)
        if len(parts) != 3 or parts[1] not in LIVE_STATES or (
                parts[1] == "COMPLETING" and not ending):
            continue
        if os.path.realpath(parts[2]) == want:
            jobs.append((parts[0], parts[1]))
    return jobs
