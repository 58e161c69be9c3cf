"""Checkpoints: the manager (when, where, which to resume) and one module per mode."""

from pyrecover.checkpoint.manager import CheckpointManager
from pyrecover.checkpoint.store import Checkpoint, CheckpointError

__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager"]
