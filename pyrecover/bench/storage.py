"""The storage side of measuring: evict files from the page cache, see what stayed, delete.

Between a write and a cold read the page cache of the written files is dropped with
`posix_fadvise(POSIX_FADV_DONTNEED)` after an fsync (no root needed), and `mincore` checks how
much of each file really left the cache.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Iterable
from pathlib import Path


def drop_cache(paths: Iterable[Path], system: bool = False) -> None:
    """drop_cache evicts the files from the page cache: fsync then POSIX_FADV_DONTNEED.

    With `system`, also writes 1 to /proc/sys/vm/drop_caches (root only; drops every file).
    """
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if system:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")


def cached_fraction(paths: Iterable[Path]) -> float | None:
    """cached_fraction is the share of the files' pages in the page cache (mincore), or None."""
    libc = _libc()
    if libc is None:
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = resident = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
            if addr in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                vec = (ctypes.c_ubyte * pages)()
                if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
                    return None
                resident += sum(b & 1 for b in vec)
            finally:
                libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
        finally:
            os.close(fd)
        total += pages
    return resident / total if total else 0.0


def _libc():
    name = ctypes.util.find_library("c")
    if not name:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


def remove(path: Path) -> None:
    """remove deletes a file and commits the deletion (fsync of its folder), outside any timing.

    ext4 reuses freed blocks only once the deletion is committed to its journal; without this,
    whichever write comes next would wait for that commit and be charged for it.
    """
    from pyrecover.checkpoint.store import fsync_dir

    path.unlink()
    fsync_dir(path.parent)


def files_in(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())

