"""Vanilla mode: rank 0 writes the whole training state as one `torch.save` file.

The seed projects' baseline, kept because it is simple and portable: one file any PyTorch
can read. It is written through `HashedFile`, like DCP's and memory mode's files: checksummed
from memory while written (in parallel blocks), so it costs no second pass over the bytes.
Every rank reads the same file, memory-mapped, so a load costs page-cache hits rather than
one private copy of the file per rank.
"""

from __future__ import annotations

from typing import Any

import torch

from pyrecover import dist
from pyrecover.checkpoint import rng
from pyrecover.checkpoint.hashed_file import HashedFile
from pyrecover.checkpoint.mode import Checkpoint, Parts, Pending, Restored, WriteResult

NAME = "vanilla"
STATE_FILE = "state.pt"


def full_state(parts, train: dict[str, Any], rngs: list[dict[str, Any]]) -> dict[str, Any]:
    """full_state is everything a vanilla file holds, as plain tensors and data."""
    return {
        "model": parts.model.state_dict(),
        "optimizer": parts.optimizer.state_dict(),
        "scheduler": parts.scheduler.state_dict(),
        "train": train,
        "rng": rngs,
        "config": parts.config,
    }


def write_state(path, state: dict[str, Any]) -> dict[str, Any]:
    """write_state `torch.save`s `state` to `path`, fsynced, and returns its manifest entry.
    A failed write (a full disk) raises the OSError, not torch's RuntimeError around it."""
    with HashedFile(str(path)) as out:
        try:
            torch.save(state, out)
        except RuntimeError as exc:
            if isinstance(out.error, OSError):
                raise out.error from exc
            raise
        return out.close()


def load_file(ckpt: Checkpoint) -> dict[str, Any]:
    """load_file maps the state file into memory; only tensors and plain data are unpickled."""
    return torch.load(ckpt.path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)


class VanillaMode:
    name = NAME
    asynchronous = False

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._result: WriteResult | None = None

    def start(self, pending: Pending, parts: Parts, train: dict[str, Any]) -> None:
        rngs = dist.gather_objects(rng.capture(), self.world_size)  # every rank takes part
        files, error = {}, ""
        if self.rank == 0:
            try:
                pending.files[STATE_FILE] = write_state(pending.tmp / STATE_FILE,
                                                        full_state(parts, train, rngs))
                files = dict(pending.files)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._result = WriteResult(files, error)

    def wait_staged(self) -> None:
        pass  # start() returns once the state is written

    def result(self, wait: bool) -> WriteResult | None:
        return self._result  # written synchronously in start()

    def restore(self, ckpt: Checkpoint, parts: Parts) -> Restored:
        state = load_file(ckpt)
        parts.model.load_state_dict(state["model"])
        parts.optimizer.load_state_dict(state["optimizer"])
        parts.scheduler.load_state_dict(state["scheduler"])
        rngs = state["rng"]
        return Restored(train=dict(state["train"]),
                        rng=rngs[self.rank] if self.rank < len(rngs) else None)

    def close(self) -> None:
        pass
