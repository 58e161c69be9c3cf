"""Vanilla mode: rank 0 writes the whole training state as one `torch.save` file.

The seed projects' baseline, kept because it is simple and portable: one file any PyTorch
can read. Every rank reads the same file, memory-mapped, so a load costs page-cache hits
rather than one private copy of the file per rank.
"""

from __future__ import annotations

from typing import Any

import torch

from pyrecover.checkpoint.store import Checkpoint, Pending

NAME = "vanilla"
STATE_FILE = "state.pt"


def save(pending: Pending, state: dict[str, Any]) -> None:
    """save writes `state` into the pending checkpoint; call on rank 0 only."""
    with pending.open(STATE_FILE) as f:
        torch.save(state, f)


def load(ckpt: Checkpoint) -> dict[str, Any]:
    """load maps the state file into memory; never unpickles anything but tensors and plain data."""
    return torch.load(ckpt.path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
