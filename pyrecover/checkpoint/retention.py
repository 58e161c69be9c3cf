"""Retention: the committed checkpoints a commit retires, and renaming them aside.

A commit of step N keeps the newest `keep` checkpoints at or below N and retires the rest.
A folder above N is neither retired nor counted: it is one the resume skipped (it did not
verify, or could not be restored), so it is no checkpoint this run can go back to, and
counting it would retire a loadable one, or, where the run started over below it, the very
checkpoint just committed. It stays until the run commits its step again, which keeps it
aside (store.Pending.commit).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

from pyrecover.checkpoint import store


def retired(root: Path, keep: int, committed: int) -> list[tuple[int, Path]]:
    """retired lists the step folders a commit of step `committed` retires, newest first."""
    return [(s, f) for s, f in store.committed_steps(root) if s <= committed][keep:]


def retire(root: Path, keep: int, committed: int) -> list[Path]:
    """retire renames the folders `retired` names aside (atomic: they no longer exist for the
    loader, and a start cleans up what is left) and returns the new names, to delete."""
    doomed = []
    for step, folder in retired(root, keep, committed):
        aside = folder.with_name(f".old-step-{step}-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(folder, aside)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        doomed.append(aside)
    return doomed
