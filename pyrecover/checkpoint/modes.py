"""The checkpoint modes a run can use: `checkpoint.mode` -> the writer/reader of that format."""

from __future__ import annotations

from collections.abc import Callable

from pyrecover.checkpoint.mode import Mode, ModeSettings
from pyrecover.checkpoint.store import CheckpointError
from pyrecover.checkpoint.vanilla import VanillaMode


def _dcp(rank: int, world_size: int, s: ModeSettings) -> Mode:
    # Imported where used: torch.distributed.checkpoint took 1.0-2.5 s to import here, on every
    # rank of every start, in runs that never touch it.
    from pyrecover.checkpoint.dcp import DcpMode

    return DcpMode(rank, world_size, s.device, s.async_save)


def _memory(rank: int, world_size: int, s: ModeSettings) -> Mode:
    from pyrecover.checkpoint.memory import MemoryMode  # imports torch.distributed.checkpoint

    return MemoryMode(rank, world_size, s.device, s.replicas, s.ranks_per_node)


# The modes a run can use: its `checkpoint.mode` -> how to make one for a rank.
MODES: dict[str, Callable[[int, int, ModeSettings], Mode]] = {
    VanillaMode.name: lambda rank, world_size, s: VanillaMode(rank, world_size),
    "dcp": _dcp,
    "memory": _memory,
}


def make_mode(name: str, rank: int, world_size: int, settings: ModeSettings) -> Mode:
    """make_mode returns the writer/reader of one checkpoint format."""
    if name not in MODES:
        raise CheckpointError(f"checkpoint mode {name!r} is not supported here")
    return MODES[name](rank, world_size, settings)
