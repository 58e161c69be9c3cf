"""`pyrecover status STORAGE`: the runs a storage folder holds, one row each, newest first.

A storage folder (`run.storage`) holds run directories and sweep folders side by side. Each
folder directly inside it that is a run or a sweep is one row; a folder nested deeper is
not searched. A row is read as `pyrecover status RUN` reads the run (status.read), so its
state is in the same words; SLURM is asked once for all rows (`jobs`, squeue's lines of this
user's live jobs), not once per run; a folder that cannot be read, or whose
run cannot be (a permission, a damaged sweep record), is a row that says why, never the
end of the list. Nothing here writes.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pyrecover import status as run_status
from pyrecover.rundir import RunDir
from pyrecover.slurm import query
from pyrecover.sweep import record

UNREADABLE = "unreadable"


@dataclass
class Row:
    name: str
    kind: str
    """run, sweep, or unknown (a folder that cannot be listed may hold either)."""
    path: str
    state: str
    """A run's state as `pyrecover status RUN` says it; `sweep` for a sweep; `unreadable: why`."""
    step: int | None = None
    max_steps: int | None = None
    checkpoint_step: int | None = None
    checkpoint_age_s: float | None = None
    job_id: str | None = None
    """A run's newest SLURM job (one queued to run it again too), a sweep's newest job array."""
    slurm_state: str | None = None
    """That job's state in SLURM's queue (PENDING, RUNNING, ...); None where it has left it."""
    goodput: float | None = None
    trials: int | None = None
    hint: str | None = None
    """The command that shows more (a sweep's trials)."""
    active: float = 0.0
    """When its files last changed (seconds since the epoch): the rows' order, newest first."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rows(folder: str | Path, now: float | None = None, jobs: str | None = None) -> list[Row]:
    """rows lists the runs and sweeps directly inside `folder`, most recently active first
    (an empty list: none there). `now` is the time checkpoint ages are measured to; `jobs`
    the user's live jobs (query.my_jobs; None: SLURM not asked)."""
    now = time.time() if now is None else now
    found = []
    for child in sorted(Path(folder).iterdir()):
        if child.is_dir():
            row = _row(child, now, jobs)
            if row is not None:
                found.append(row)
    return sorted(found, key=lambda r: (-r.active, r.name))


def _row(path: Path, now: float, jobs: str | None = None) -> Row | None:
    """_row is the row of one folder of the storage, or None where it holds no run."""
    try:
        os.listdir(path)
        os.stat(os.path.join(path, "."))  # its files can be looked up (r-- lists, no more)
    except OSError as exc:
        return Row(path.name, "unknown", str(path), _unreadable(path, exc),
                   active=_active([path]))
    run = RunDir(path)
    if run.is_sweep() and not run.config.is_file():
        return _sweep_row(path, query.parse_states(jobs or ""))
    if not run.is_run():
        return None
    files = [path, run.config, run.events, run.metrics, run.checkpoints]
    try:
        s = run_status.read(path, now=now, **_asked(jobs))
    except (OSError, ValueError) as exc:  # StatusError: a checkpoints file, not a folder
        return Row(path.name, "run", str(path), _unreadable(path, exc), active=_active(files))
    ckpt = s.last_checkpoint or {}
    return Row(path.name, "run", str(path), s.state, step=s.step, max_steps=s.max_steps,
               checkpoint_step=ckpt.get("step"), checkpoint_age_s=ckpt.get("age_s"),
               job_id=s.job_id, slurm_state=s.slurm_state, goodput=s.goodput,
               active=_active(files))


def _asked(jobs: str | None) -> dict[str, Any]:
    """_asked is what status.read asks SLURM, answered from `jobs` (no SLURM command each):
    a job's state where it is in the queue, and the jobs queued to run a job script."""
    if jobs is None:
        return {}
    states = query.parse_states(jobs)
    return {"squeue": states.get, "queued": lambda script: query.parse_queued(jobs, script)}


def _sweep_row(path: Path, states: dict[str, str]) -> Row:
    """_sweep_row: a sweep's name, its number of trials and the command that shows them."""
    files = [path, path / record.RECORD, path / record.JOBS]
    hint = f"pyrecover sweep status {shlex.quote(str(path))}"
    try:
        trials = record.read(path).trials
        array = record.last_job(path)
    except (OSError, ValueError) as exc:  # SweepError: a damaged sweep.yaml
        return Row(path.name, "sweep", str(path), _unreadable(path, exc), hint=hint,
                   active=_active(files))
    for trial in trials:
        run = RunDir(path / str(trial["dir"]))
        files += [run.root, run.events, run.metrics]
    live = sorted({state for job, state in states.items()
                   if array and job.partition("_")[0] == str(array)})
    return Row(path.name, "sweep", str(path), "sweep", job_id=array, trials=len(trials),
               slurm_state=",".join(live) or None, hint=hint, active=_active(files))


def _unreadable(path: Path, exc: BaseException) -> str:
    """_unreadable says why a folder's row could not be read, its paths inside it named
    from it (`permission denied: events.jsonl`)."""
    if isinstance(exc, PermissionError):
        inside = _inside(path, exc.filename)
        why = "permission denied" + (f": {inside}" if inside else "")
    elif isinstance(exc, OSError):
        where = _inside(path, exc.filename) or ""
        why = f"{where}: {exc.strerror or exc}" if where else str(exc.strerror or exc)
    else:
        why = str(exc).replace(f"{path}{os.sep}", "")
    return f"{UNREADABLE}: {why}"


def _inside(path: Path, filename: Any) -> str:
    """_inside names `filename` (an OSError's) from the folder `path`; '' for the folder."""
    if filename is None:
        return ""
    name = os.fsdecode(filename)
    return "" if Path(name) == path else name.replace(f"{path}{os.sep}", "")


def _active(paths: list[Path]) -> float:
    """_active is when the newest of `paths` last changed (0.0 where none can be read)."""
    times = [0.0]
    for path in paths:
        try:
            times.append(path.stat().st_mtime)
        except OSError:
            pass
    return max(times)
