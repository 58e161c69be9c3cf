"""Checkpoints: the manager (when, where, which to resume) and one module per mode.

`CheckpointManager` is imported on first use (PEP 562), so the pure modules here (`store`,
`trust`) load without torch: `pyrecover train`'s read-ahead (readahead.py) runs on them
before torch is imported."""

from typing import Any

from pyrecover.checkpoint.store import Checkpoint, CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from pyrecover.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
