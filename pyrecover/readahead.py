"""Read-ahead: the checkpoint a start will resume, read into the page cache while the trainer
imports torch.

A restart imports torch before it can do anything else (3.7 s of the 1 GB restart on the
16-core H200 machine, 1.2-1.4 s on the 2-core VM), and then reads the newest checkpoint whole:
rank 0's checksum pass, and the restore. The stop checkpoint was written past the page cache,
so both wait on storage. `start`, called by `pyrecover train` before it imports the trainer,
starts a daemon thread that finds the newest committed checkpoint and reads its files once:
the imports hold the interpreter, the read waits on the disk (and lets go of the interpreter
while it does), so the two overlap, and the checksum pass and the restore then read memory.

What is read: the newest `step-<N>` folder whose manifest is valid as the store reads it (a
real folder, not a link; plain file names), on rank 0, which checksums every file, all of a
vanilla or DCP checkpoint; on the first rank of every other node, only a vanilla one (one
file every rank's restore reads whole; a DCP checkpoint's shards may be other ranks').
Nothing of memory mode's (its parts
are every slice twice over, and a survivors' snapshot, committed only once the run directory
is locked, may be newer), nothing where a snapshot waits to be committed, nothing larger than
a quarter of the memory available (the page cache would evict it again before it is read).
Only regular files the manifest names plainly, opened without following links.

Best effort: nothing here may stop a start. Errors are ignored; the pick and the restore read
the files again and report them. No torch (the standard library and the store's pure
modules): this runs before torch is imported.
"""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

from pyrecover.checkpoint import store  # no torch: checkpoint/__init__.py imports it lazily

BLOCK = 8 << 20
MEMORY_SHARE = 4  # read ahead only what fits in 1/MEMORY_SHARE of the available memory
MODES = {"vanilla": "every node", "dcp": "rank 0"}  # what is read ahead, and by whom


def newest_files(checkpoints: Path) -> tuple[str, list[Path]]:
    """newest_files is (mode, files) of the newest committed checkpoint under `checkpoints`
    whose manifest is valid (store.read_manifest: a real folder, plain names only); ("", [])
    where there is none, or a survivors' snapshot waits to be committed."""
    if any(checkpoints.glob(store.SNAPSHOT_GLOB)):
        return "", []
    for _, folder in store.committed_steps(checkpoints):
        try:
            manifest = store.read_manifest(folder)
        except store.CheckpointError:
            continue  # the pick will say why; an older one may be what it takes
        return manifest["mode"], [folder / name for name in sorted(manifest["files"])]
    return "", []


def available_bytes() -> int | None:
    """available_bytes is the memory available without swapping: the kernel's estimate, or
    less where this process's cgroup (a SLURM job's) has less room left under its limit."""
    room = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                room.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    try:  # cgroup v2: "0::/path" in /proc/self/cgroup
        own = Path("/proc/self/cgroup").read_text().splitlines()[0].split("::", 1)[1]
        group = Path("/sys/fs/cgroup") / own.lstrip("/")
        limit = (group / "memory.max").read_text().strip()
        if limit != "max":
            room.append(int(limit) - int((group / "memory.current").read_text()))
    except (OSError, ValueError, IndexError):
        pass
    return min(room) if room else None


def plan(checkpoints: Path, rank: int, local_rank: int) -> list[Path]:
    """plan lists the files this rank reads ahead (module docstring); empty for none."""
    if local_rank != 0:
        return []
    mode, files = newest_files(checkpoints)
    if MODES.get(mode) != "every node" and not (rank == 0 and mode in MODES):
        return []
    total = sum(path.lstat().st_size for path in files)
    room = available_bytes()
    if room is not None and total > room // MEMORY_SHARE:
        return []
    return files


def read_through(path: Path, block: int = BLOCK) -> None:
    """read_through reads `path` once into a reused buffer (page cache warm-up): a regular
    file only, not through a symbolic link; errors are left for whoever reads it next."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO: no wait
    except OSError:
        return
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return
        buf = bytearray(block)
        with open(fd, "rb", buffering=0, closefd=False) as f:
            while f.readinto(buf):
                pass
    except OSError:
        pass
    finally:
        os.close(fd)


def start(checkpoints: Path, rank: int, local_rank: int) -> threading.Thread | None:
    """start reads ahead what `plan` lists, both in a daemon thread (the listing too: on a
    network file system its metadata calls may take a while); the thread, or None where this
    rank reads nothing."""
    if local_rank != 0:
        return None

    def work() -> None:
        try:
            for path in plan(checkpoints, rank, local_rank):
                read_through(path)
        except Exception:  # best effort (module docstring): the start goes on regardless
            pass

    thread = threading.Thread(target=work, name="pyrecover-readahead", daemon=True)
    thread.start()
    return thread
