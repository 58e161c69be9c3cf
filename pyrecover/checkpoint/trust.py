"""The same job's own record of a checkpoint it committed, so its restart need not read every
byte again before loading.

A commit checksums each file from the bytes as they are written and fsyncs it; then, under
SLURM, rank 0 records in the manifest (`written_by`) the job id, the job's node list and each
file's inode, size, modification and change times (nanoseconds), read after the fsync. A
restart of that job on the same node set (a requeue that lands on the same nodes, an in-job
restart) whose files still show exactly those stats skips the second checksum pass over them.
Anything that writes to a file, truncates it, replaces it or even sets its times back moves
its change time (the kernel sets ctime; no system call sets it to a chosen value; where the
kernel stamps times once per tick, the record is made only once that tick has passed), so such a
file is checked in full, as is everything written by another job, on other nodes or outside
SLURM. What this does not catch is what no stat can see: a storage medium flipping bits
under an unchanged file within one job's life. `pyrecover ckpt verify` and a resume in any
other job still read every byte.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

KEY = "written_by"


def signature(path: Path) -> list[int]:
    """signature is what the record compares: inode, size, mtime and ctime in nanoseconds."""
    st = path.lstat()
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _job(environ: Mapping[str, str]) -> dict[str, str] | None:
    job, nodes = environ.get("SLURM_JOB_ID"), environ.get("SLURM_JOB_NODELIST")
    return {"job": job, "nodes": nodes} if job and nodes else None


def record(folder: Path, names: list[str], environ: Mapping[str, str] = os.environ
           ) -> dict[str, Any]:
    """record is the manifest entry for the files `names` in `folder` (fsynced, checksummed),
    or {} outside SLURM."""
    job = _job(environ)
    if job is None:
        return {}
    files = {n: signature(folder / n) for n in names}
    if files and not _clock_moved_past(folder, max(sig[3] for sig in files.values())):
        return {}  # no record: the restart checks every byte, as without one
    return {KEY: {**job, "files": files}}


def _clock_moved_past(folder: Path, newest_ctime_ns: int, limit_s: float = 0.2) -> bool:
    """_clock_moved_past returns once a change made in `folder` now gets a later change time
    than `newest_ctime_ns` (False if that does not happen within `limit_s`).

    Before Linux 6.13 (most clusters' kernels) file times advance once per timer tick (1-10
    ms): a write in the same tick as the stats just recorded would leave them as they were.
    Waiting out that tick (a probe file, removed again) makes every later write visible."""
    probe = folder / ".trust-clock"
    deadline = time.monotonic() + limit_s
    try:
        while True:
            os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
            if probe.lstat().st_ctime_ns > newest_ctime_ns:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.001)
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def trusted(folder: Path, manifest: Mapping[str, Any],
            environ: Mapping[str, str] | None) -> set[str]:
    """trusted names the files of `folder` whose checksum pass may be skipped: none unless
    this process runs in the job, on the node set, that recorded them, and only those whose
    stats are unchanged since."""
    entry = manifest.get(KEY)
    job = _job(environ) if environ is not None else None
    if job is None or not isinstance(entry, dict) or any(entry.get(k) != v
                                                         for k, v in job.items()):
        return set()
    files = entry.get("files")
    if not isinstance(files, dict):
        return set()
    out = set()
    for name, saved in files.items():
        try:
            if name in manifest["files"] and signature(folder / name) == saved:
                out.add(name)
        except OSError:
            continue
    return out
