"""The run lock: rank 0's exclusive hold on a run directory for the life of the run, and
what `status`, `launch` and `demo` read of it (the live holder), without taking it.

One run directory has one live run (DESIGN.md): a second start is refused (RunLocked), and a
requeued job whose earlier start still holds it waits, then requeues again (HeldByThisJob).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from pyrecover.rundir import RunDir, storage_error

log = logging.getLogger("pyrecover")

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
