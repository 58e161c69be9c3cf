"""Entries of a checkpoints folder as they are on disk: asked once, links never followed.

Storage that fails (EIO, ESTALE) is an error here, never "nothing there": a manifest that
cannot be read must not pass for a save that never committed, which would send a start back
to step 0 (pathlib's `is_file()` and `is_dir()` answer False for any OSError from Python
3.13 on). And a symbolic link is never walked into: removing a leftover removes the link,
not the files of whatever it points at (another run's checkpoint).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

# What a killed save (`.tmp-step-*`) or retention (`.old-step-*`, being deleted) leaves.
LEFTOVER_PREFIXES = (".tmp-step-", ".old-step-")


def mode_of(path: Path) -> int | None:
    """mode_of is the st_mode of `path` itself (a link is a link), None where nothing is
    there; any other OSError is raised."""
    try:
        return os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None


def is_dir_or_link(path: Path) -> bool:
    """is_dir_or_link: a real folder, or a symbolic link (which verify then refuses)."""
    mode = mode_of(path) or 0
    return stat.S_ISDIR(mode) or stat.S_ISLNK(mode)


def is_file(path: Path) -> bool:
    """is_file: a regular file, not a link to one."""
    return stat.S_ISREG(mode_of(path) or 0)


def is_link(path: Path) -> bool:
    """is_link: a symbolic link, whatever it points at."""
    return stat.S_ISLNK(mode_of(path) or 0)


def is_real_dir(path: Path) -> bool:
    """is_real_dir: a folder, not a link to one."""
    return stat.S_ISDIR(mode_of(path) or 0)


_removed = 0  # entries clean_uncommitted has removed, in this process


def removed_entries() -> int:
    """removed_entries is how many files and folders `clean_uncommitted` has removed so far in
    this process: it moves only as a removal returns, so rank 0's beats while it tidies a
    killed save's many files follow it (resume.py), and stand still where storage hangs."""
    return _removed


def clean_uncommitted(root: Path) -> list[Path]:
    """clean_uncommitted removes temporary folders a killed save left behind; returns them.
    A leftover name that is a symbolic link loses the link only. Errors are ignored (what is
    left is removed at the next start)."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if not p.name.startswith(LEFTOVER_PREFIXES):
                continue
            if is_link(p):
                _remove(os.unlink, str(p))
            elif is_real_dir(p):
                for folder, dirs, files in os.walk(p, topdown=False):  # links are not followed
                    links = [d for d in dirs if os.path.islink(os.path.join(folder, d))]
                    for name in files + links:
                        _remove(os.unlink, os.path.join(folder, name))
                    _remove(os.rmdir, folder)
            else:
                continue
            removed.append(p)
    return removed


def _remove(remove: Callable[[str], None], path: str) -> None:
    global _removed
    try:
        remove(path)
    except OSError:
        pass
    _removed += 1
