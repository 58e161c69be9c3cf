"""The checkpoint manager: when to save, the commit, retention, and which checkpoint to resume.

Rank 0 decides which checkpoint to resume from (verifying checksums once, not on every rank)
and tells the others; every rank then loads that same step. Saves run at step boundaries
that every rank reaches together; the manager returns only after the checkpoint is committed,
so a `checkpoint` event always names a folder that exists.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from pyrecover.checkpoint import store, vanilla
from pyrecover.checkpoint.store import Checkpoint
from pyrecover.rundir import RunDir

log = logging.getLogger("pyrecover")

MODES = {vanilla.NAME: vanilla}


class CheckpointManager:
    def __init__(self, run: RunDir, mode: str, interval: int, keep: int, rank: int,
                 world_size: int) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown checkpoint mode {mode!r}")
        self.run, self.mode, self.interval, self.keep = run, mode, interval, keep
        self.rank, self.world_size = rank, world_size
        self.root = run.checkpoints
        self.last_save_seconds = 0.0
        self.last_saved_step: int | None = None

    def should_save(self, step: int, max_steps: int) -> bool:
        return step % self.interval == 0 or step == max_steps

    def save(self, step: int, state: dict[str, Any]) -> Path | None:
        """save commits the checkpoint of `step` and returns its folder (on rank 0; None elsewhere).

        `state` is complete on rank 0; other ranks pass what they have and only wait.
        """
        started = time.perf_counter()
        folder = None
        if self.rank == 0:
            pending = store.begin(self.root, step)
            try:
                MODES[self.mode].save(pending, state)
                folder = pending.commit(self.mode, self.world_size, state["train"])
            except BaseException:
                pending.abort()
                raise
        _barrier()
        self.last_save_seconds = time.perf_counter() - started
        self.last_saved_step = step
        if self.rank == 0 and folder is not None:
            size = sum(f["size"] for f in store.read_manifest(folder)["files"].values())
            self.run.event("checkpoint", step=step, mode=self.mode, path=str(folder),
                           bytes=size, seconds=round(self.last_save_seconds, 4))
            log.info("checkpoint step %d committed: %s (%.1f MB, %.2fs)", step, folder,
                     size / 1e6, self.last_save_seconds)
            self._retain()
        return folder

    def _retain(self) -> None:
        for _, folder in store.committed_steps(self.root)[self.keep:]:
            shutil.rmtree(folder, ignore_errors=True)

    def find_resume(self) -> Checkpoint | None:
        """find_resume picks the newest checkpoint that verifies (rank 0) and agrees on it.

        Uncommitted temporary folders are removed; corrupt checkpoints are reported and kept
        for inspection, never loaded.
        """
        choice: list[Any] = [None]
        found: Checkpoint | None = None
        if self.rank == 0:
            for tmp in store.clean_uncommitted(self.root):
                log.warning("removed uncommitted checkpoint folder %s", tmp.name)
            for step, folder, ckpt, problem in store.scan(self.root):
                if ckpt is not None:
                    choice, found = [str(folder)], ckpt
                    break
                log.warning("skipping checkpoint step %d: %s", step, problem)
                self.run.event("checkpoint_invalid", step=step, path=str(folder), reason=problem)
        if tdist.is_initialized():
            tdist.broadcast_object_list(choice, src=0)
        if choice[0] is None or found is not None:
            return found
        # Other ranks trust rank 0's checksum pass; the sizes are cheap to check again.
        return store.verify(Path(choice[0]), checksums=False)

    def load(self, ckpt: Checkpoint) -> dict[str, Any]:
        if ckpt.mode not in MODES:
            raise store.CheckpointError(f"{ckpt.path}: mode {ckpt.mode!r} is not supported here")
        return MODES[ckpt.mode].load(ckpt)


def _barrier() -> None:
    if tdist.is_initialized():
        tdist.barrier()

