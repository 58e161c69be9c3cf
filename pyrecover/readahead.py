"""Read-ahead: the checkpoint a start will resume, read into the page cache while the trainer
imports torch.

A restart imports torch before it can do anything else (3.7 s of the 1 GB restart on the
16-core H200 machine, 2-4 s on the 2-core VM), and then reads the newest checkpoint whole:
rank 0's checksum pass, and the restore. The stop checkpoint was written past the page cache,
so both wait on storage. `start`, called by `pyrecover train` before it imports the trainer,
reads the newest committed checkpoint's files once in a daemon thread: the imports hold the
interpreter, the read waits on the disk (and lets go of the interpreter while it does), so
the two overlap, and the checksum pass and the restore then read memory.

Which files: the newest `step-<N>` folder with a readable manifest, every file it lists, on
the rank that checksums them (rank 0); on the first rank of every other node only a vanilla
checkpoint (one file every rank's restore reads whole: DCP and memory mode read their own
parts). Nothing where those files are larger than a quarter of the memory available (the
page cache would only evict them again before they are read). It only reads, and reads
nothing outside the folder: listed names are plain file names, opened without following
links. Errors are ignored: the pick and the restore read the files again and report them.

Only the standard library: this runs before torch is imported.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

BLOCK = 8 << 20
MEMORY_SHARE = 4  # read ahead only what fits in 1/MEMORY_SHARE of the available memory


def newest_files(checkpoints: Path) -> tuple[str, list[Path]]:
    """newest_files is (mode, files) of the newest committed checkpoint under `checkpoints`
    whose manifest reads; ("", []) where there is none."""
    try:
        folders = sorted(((int(p.name[5:]), p) for p in checkpoints.iterdir()
                          if p.name.startswith("step-") and p.name[5:].isdigit()),
                         reverse=True)
    except OSError:
        return "", []
    for _, folder in folders:
        try:
            manifest = json.loads((folder / "manifest.json").read_text())
            names = list(manifest["files"])
            mode = str(manifest.get("mode", ""))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # the pick will say why; an older one may be what it takes
        if all(isinstance(n, str) and n == Path(n).name and n not in ("", ".", "..")
               for n in names):
            return mode, [folder / n for n in sorted(names)]
    return "", []


def available_bytes() -> int | None:
    """available_bytes is the kernel's estimate of memory available without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def plan(checkpoints: Path, rank: int, local_rank: int) -> list[Path]:
    """plan lists the files this rank reads ahead (module docstring); empty for none."""
    if local_rank != 0:
        return []
    mode, files = newest_files(checkpoints)
    if rank != 0 and mode != "vanilla":
        return []
    total = 0
    for path in files:
        try:
            total += path.lstat().st_size
        except OSError:
            return []
    room = available_bytes()
    if room is not None and total > room // MEMORY_SHARE:
        return []
    return files


def read_through(path: Path, block: int = BLOCK) -> None:
    """read_through reads `path` once into a reused buffer (page cache warm-up), without
    following a symbolic link; errors are left for whoever reads it next."""
    buf = bytearray(block)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return
    try:
        with open(fd, "rb", buffering=0, closefd=False) as f:
            while f.readinto(buf):
                pass
    except OSError:
        pass
    finally:
        os.close(fd)


def start(checkpoints: Path, rank: int, local_rank: int) -> threading.Thread | None:
    """start reads ahead, in a daemon thread, what `plan` lists; the thread, or None."""
    files = plan(checkpoints, rank, local_rank)
    if not files:
        return None

    def work() -> None:
        for path in files:
            read_through(path)

    thread = threading.Thread(target=work, name="pyrecover-readahead", daemon=True)
    thread.start()
    return thread
