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
import threading
import uuid
from pathlib import Path

from pyrecover.checkpoint import entries, store


def retired(root: Path, keep: int, committed: int, skipped: frozenset[int] = frozenset()
            ) -> list[tuple[int, Path]]:
    """retired lists the step folders a commit of step `committed` retires, newest first.
    `skipped` are the steps this run's resume found invalid and has not saved again: below
    `committed` too (a stop save at 437 found corrupt, the run resumed from 400 and committed
    500) they are neither counted nor retired, as a folder above it is not: counted, 437
    retired 400, the checkpoint just resumed from, and left one loadable checkpoint of
    `keep`. A `step-N`
    that is a symbolic link is no checkpoint this run wrote: neither counted nor retired."""
    return [(s, f) for s, f in store.committed_steps(root)
            if s <= committed and s not in skipped and entries.is_real_dir(f)][keep:]


def retire(root: Path, keep: int, committed: int, skipped: frozenset[int] = frozenset()
           ) -> list[Path]:
    """retire renames the folders `retired` names aside (atomic: they no longer exist for the
    loader, and a start cleans up what is left) and returns the new names, to delete."""
    doomed = []
    for step, folder in retired(root, keep, committed, skipped):
        aside = folder.with_name(f".old-step-{step}-{uuid.uuid4().hex[:8]}")
        try:
            os.replace(folder, aside)
        except OSError:
            shutil.rmtree(folder, ignore_errors=True)
            continue
        doomed.append(aside)
    return doomed


class Retention:
    """Retention keeps the newest `keep` checkpoints of `root` at each commit: the others are
    renamed aside at once, then deleted by a background thread (deleting a large checkpoint
    took 0.14 s per GB here, which the loop would otherwise wait for at the step boundary of
    every commit). `skipped` collects the steps the run's resume found invalid."""

    def __init__(self, root: Path, keep: int) -> None:
        self.root, self.keep = root, keep
        self.skipped: set[int] = set()
        self._deleting: threading.Thread | None = None

    def after_commit(self, committed: int) -> None:
        self.skipped.discard(committed)  # a skipped step saved again: a good one, counted
        doomed = retire(self.root, self.keep, committed, frozenset(self.skipped))
        if doomed:
            self.wait()
            self._deleting = threading.Thread(
                target=lambda: [shutil.rmtree(d, ignore_errors=True) for d in doomed],
                name="pyrecover-retain", daemon=True)
            self._deleting.start()

    def wait(self) -> None:
        """wait returns once the folders retired so far are deleted."""
        if self._deleting is not None:
            self._deleting.join()
            self._deleting = None
