"""The run directory: where one experiment keeps its config, events, metrics and checkpoints.

    <storage>/<exp_name>/
      run.yaml  job.sbatch  events.jsonl  metrics.jsonl  logs/  checkpoints/step-<N>/  wandb/
      compile-cache/  (torch.compile's kernels, for restarts on other nodes)

Appends to the JSONL files are single `write` calls of one line each, so a reader never sees
half a record from a live writer, and a killed writer leaves at most one torn last line,
which `read_jsonl` skips. This module imports nothing else from the project.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
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


# flock's errors where a file system has no locks at all (not "someone holds it").
_NO_LOCKS = {errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOLCK}


class RunLocked(RuntimeError):
    """Another live process holds the run directory (exit code 2: a user error, not a fault)."""


class HeldByThisJob(RuntimeError):
    """The run directory's lock is still held by an earlier start of this same SLURM job (a
    step of it that has not let go: a process stuck on a failed node, unkillable in a GPU
    driver, or a lock a vanished NFS client left): a fault, exit 1, so the job script
    requeues the job (counted as a failure) instead of ending the run as a user error."""


class RunLock:
    """RunLock is rank 0's exclusive hold on a run directory for the life of the run.

    An `flock` on `run.lock`: the kernel releases it when the holder dies, however it dies,
    so a stale lock of a dead process never blocks. The file names the holder (host, pid,
    SLURM job id) for the refusal message; its content is informative only.
    """

    def __init__(self, run: RunDir) -> None:
        self.run = run
        self._fd: int | None = None

    def acquire(self, wait_s: float = 0.0) -> RunLock:
        """acquire takes the lock, retrying for up to `wait_s` seconds (a requeued job whose
        previous instance is still shutting down); raises RunLocked naming the holder."""
        try:
            fd = os.open(self.run.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise storage_error("create", self.run.lock_file, exc) from None
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    holder, info = _read_holder(fd), _holder_info(fd) or {}
                    os.close(fd)
                    job = os.environ.get("SLURM_JOB_ID")
                    if job and str(info.get("job_id")) == job:
                        raise HeldByThisJob(
                            f"{self.run.root} is still held by an earlier start of this job "
                            f"({holder}) after {wait_s:.0f} s: a process stuck on its node; "
                            "ending with exit 1 so the job requeues and tries again") from None
                    raise RunLocked(
                        f"{self.run.root} is in use by another run ({holder}); one run "
                        "directory has one live run: wait for it to end, or use another "
                        "run.exp_name") from None
                time.sleep(0.5)
            except OSError as exc:
                if exc.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise storage_error("lock", self.run.lock_file, exc) from None
                # Lustre mounted without `flock`, some FUSE and NFS setups: the run goes on
                # (refusing would stop every run there), without the guard, and says so.
                log.warning("%s: this storage has no file locks (%s): running without the "
                            "guard against a second live run; do not start this run twice",
                            self.run.lock_file, os.strerror(exc.errno or 0))
                break
        holder = {"host": socket.gethostname(), "pid": os.getpid(),
                  "job_id": os.environ.get("SLURM_JOB_ID"), "since": round(time.time(), 3)}
        self._fd = fd
        try:  # informative only: a full disk must not cost the lock
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(holder) + "\n").encode(), 0)
        except OSError:
            pass
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def live_holder(run: RunDir) -> str | None:
    """live_holder names the live process holding the run directory's lock (host, pid, SLURM
    job), '' where none holds it and its last holder is known dead (its last start ended,
    however it ended), None where this cannot tell (no lock file, storage without locks, or a
    free lock last held from another host). It only reads: a shared lock taken for an
    instant, which a start that finds it waits out (`lock_wait_seconds`).

    A held lock means a live holder wherever it runs. A free one proves nothing about a
    holder on another node: where flock is node-local (Lustre mounted `localflock`, NFS with
    `local_lock=all` or `local_lock=flock`) another node's lock is invisible here. So a free
    lock says '' only when the file names this host as its holder's and that pid is gone."""
    try:
        fd = os.open(run.lock_file, os.O_RDONLY)
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_holder(fd)
        except OSError:
            return None
        info = _holder_info(fd)
    finally:
        os.close(fd)  # (releases the shared lock where it was taken)
    if info is None or info.get("host") != socket.gethostname():
        return None  # another node's holder, or none recorded: its lock may be unseen here
    return "" if _pid_gone(info.get("pid")) else None


def _holder_info(fd: int) -> dict[str, Any] | None:
    """_holder_info is what RunLock.acquire wrote into the lock file (host, pid, job_id,
    since); None where it is missing or garbled."""
    try:
        info = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _pid_gone(pid: Any) -> bool:
    """_pid_gone tells whether no process on this host has this pid (a zombie, dead but not
    yet reaped, is gone too: it holds no files and no locks). False where unsure."""
    if type(pid) is not int or pid <= 0:  # (0 and -N would signal process groups)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # PermissionError: alive, someone else's
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2:].startswith("Z")
    except (OSError, ValueError):
        return False


def _read_holder(fd: int) -> str:
    info = _holder_info(fd)
    if info is None:
        return "holder unknown"
    parts = [f"host {info.get('host', '?')}", f"pid {info.get('pid', '?')}"]
    if info.get("job_id"):
        parts.append(f"SLURM job {info['job_id']}")
    return ", ".join(parts)


def lock_wait_seconds(environ: dict[str, str] | None = None) -> float:
    """lock_wait_seconds is how long a start waits for a held run directory: under SLURM a
    requeued job may start while its previous instance is still shutting down (default 120 s);
    elsewhere a second start is refused after 2 s (a `status` looking at the lock holds it
    for an instant). PYRECOVER_LOCK_WAIT overrides it."""
    env = os.environ if environ is None else environ
    raw = env.get("PYRECOVER_LOCK_WAIT")
    if raw is not None:
        try:
            return max(0.0, float(raw))
        except ValueError:
            pass
    return 120.0 if env.get("SLURM_JOB_ID") else 2.0
