"""The run directory: where one experiment keeps its config, events, metrics and checkpoints.

    <storage>/<exp_name>/
      run.yaml  job.sbatch  events.jsonl  metrics.jsonl  logs/  checkpoints/step-<N>/  wandb/
      compile-cache/  (torch.compile's kernels, for restarts on other nodes)

Appends to the JSONL files are single `write` calls of one line each, so a reader never sees
half a record from a live writer, and a killed writer leaves at most one torn last line,
which `read_jsonl` skips. This module imports nothing else from the project; the run lock
is in runlock.py.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pyrecover")
SWEEP_RECORD = "sweep.yaml"  # a sweep's folder holds it (pyrecover/sweep/record.py)


class StorageError(RuntimeError):
    """The storage cannot hold the run (read-only, full, gone): exit code 1, not a config
    error; the message is one line naming the path and the reason."""


def storage_error(what: str, path: Path, exc: OSError) -> StorageError:
    return StorageError(f"storage: cannot {what} {path}: {exc.strerror or exc}")


def replace_text(path: Path, text: str) -> None:
    """replace_text replaces `path` with `text` atomically (a temporary file beside it, then
    os.replace): a reader sees the old file or the new, never a torn one. StorageError names
    the path where the storage refuses it; the temporary file is removed."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise storage_error("write", path, exc) from None


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def where(self) -> tuple[str, str]:
        """where is the run's run.storage (absolute) and run.exp_name: the folder above it and
        its own name, also where it was given as `.` or `x/..` (whose Path has no name)."""
        full = os.path.abspath(self.root)
        return os.path.dirname(full), os.path.basename(full)

    @property
    def config(self) -> Path:
        return self.root / "run.yaml"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def metrics(self) -> Path:
        return self.root / "metrics.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def job_script(self) -> Path:
        return self.root / "job.sbatch"

    @property
    def bad_nodes(self) -> Path:
        """Nodes the job script excludes (name, UTC time, reason; tab-separated lines)."""
        return self.root / "bad-nodes"

    @property
    def wandb(self) -> Path:
        return self.root / "wandb"

    @property
    def compile_cache(self) -> Path:
        """torch.compile's kernels, kept with the run so a restart on any node finds them."""
        return self.root / "compile-cache"

    @property
    def profile(self) -> Path:
        """torch.profiler's traces of `train.profile`'s steps, one per rank (profiling.py)."""
        return self.root / "profile"

    @property
    def corpus(self) -> Path:
        """The fingerprint of the data the run trained on (data.fingerprint, experiment.py)."""
        return self.root / "corpus.json"

    @property
    def lock_file(self) -> Path:
        return self.root / "run.lock"

    def create(self) -> None:
        """create makes the folders; safe to call on every start and on every rank."""
        for path in (self.root, self.checkpoints, self.logs):
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise storage_error("create", path, exc) from None

    def is_sweep(self) -> bool:
        """is_sweep tells whether this folder holds a sweep (its trials are the runs)."""
        return (self.root / SWEEP_RECORD).is_file()

    def is_run(self) -> bool:
        """is_run tells whether this folder looks like a pyrecover run directory."""
        return (self.config.is_file() or self.events.is_file() or self.metrics.is_file()
                or self.checkpoints.is_dir())

    def is_recorded_run(self) -> bool:
        """is_recorded_run: a run.yaml beside events or checkpoints (stricter than is_run:
        a home folder with a checkpoints/ of its own is no run)."""
        return self.config.is_file() and (self.events.is_file() or self.checkpoints.is_dir())

    def problem(self) -> str | None:
        """problem says why this is no run directory to read (None when it is one)."""
        if not self.root.is_dir():
            what = "is a file, not a folder" if self.root.exists() else "does not exist"
            return f"run directory {str(self.root)!r} {what}"
        if self.is_sweep() and not self.config.is_file():
            return (f"{self.root} holds a sweep, not a run: `pyrecover sweep status "
                    f"{self.root}` shows its trials, each a run ({self.root}/trial-0, ...)")
        if not self.is_run():
            return (f"{self.root} is not a pyrecover run directory (no run.yaml, events.jsonl, "
                    "metrics.jsonl or checkpoints/)")
        if self.checkpoints.exists() and not self.checkpoints.is_dir():
            return (f"{self.checkpoints} is not a folder: a run keeps its checkpoints in a "
                    "folder of that name; move the file away")
        return None

    def event(self, event: str, **fields: Any) -> dict[str, Any]:
        """event appends one record to events.jsonl with the time, host and SLURM job id."""
        record = {"event": event, "time": round(time.time(), 3), **fields}
        for key, value in attempt_fields(os.environ).items():
            record.setdefault(key, value)
        record.setdefault("host", socket.gethostname())
        self._append(self.events, record)
        return record

    def metric(self, **fields: Any) -> None:
        self._append(self.metrics, {"time": round(time.time(), 3), **fields})

    def _append(self, path: Path, record: dict[str, Any]) -> None:
        """_append writes one record; a storage that refuses it (full, read-only, the run
        directory deleted) is reported, never allowed to stop the training: the checkpoints
        are what a run needs, and their commits report their own failures."""
        try:
            append_jsonl(path, record)
        except OSError as exc:
            log.warning("could not append to %s (%s); %s not recorded", path,
                        exc.strerror or exc, record.get("event", "this step's metrics"))

    def read_events(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.events))

    def read_metrics(self) -> list[dict[str, Any]]:
        return list(read_jsonl(self.metrics))


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """append_jsonl writes one JSON line with a single O_APPEND write."""
    line = (json.dumps(record, sort_keys=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def attempt_fields(environ: dict[str, str] | os._Environ[str]) -> dict[str, Any]:
    """attempt_fields names the SLURM attempt a record belongs to (none outside SLURM): the
    job, its requeue, the job script's step inside the allocation (restarts without requeue)
    and a sweep trial's array task. The job script reads them back (slurm/blocks.py)."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    fields: dict[str, Any] = {"job_id": job,
                              "restart_count": int(environ.get("SLURM_RESTART_COUNT", "0"))}
    in_job = environ.get("PYRECOVER_IN_JOB_RESTART")
    if in_job:
        fields["in_job_restart"] = int(in_job)
    array, task = environ.get("SLURM_ARRAY_JOB_ID"), environ.get("SLURM_ARRAY_TASK_ID")
    if array and task:  # a sweep's trial: SLURM names the task ARRAYID_TASKID
        fields["array_task"] = f"{array}_{task}"
    return fields


def read_jsonl(path: Path, bad: list[int] | None = None) -> Iterator[dict[str, Any]]:
    """read_jsonl yields each complete record; a torn or garbled line, or one that is not a
    JSON object, is skipped and counted in `bad[0]` where given (not a last line without its
    newline: a record still being written). A line nested too deeply for Python's parser is
    garbled too: it must not stop a resuming trainer, whose job would requeue into it."""
    if not path.is_file():
        return
    with path.open("rb") as f:
        for raw in f:
            try:
                record = json.loads(raw)
            except (ValueError, RecursionError):
                record = None
            if isinstance(record, dict):
                yield record
            elif bad is not None and raw.endswith(b"\n"):
                bad[0] += 1
