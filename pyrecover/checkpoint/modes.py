"""The checkpoint modes a run can use: `checkpoint.mode` -> the writer/reader of that format,
and the module that reads it offline for `pyrecover ckpt` (and writes `convert --to`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from pyrecover.checkpoint import vanilla
from pyrecover.checkpoint.mode import Mode, ModeSettings, Offline, Writer
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


def _dcp_offline() -> Offline:
    from pyrecover.checkpoint import dcp

    return cast(Offline, dcp)


def _memory_offline() -> Offline:
    from pyrecover.checkpoint.memory import mode

    return cast(Offline, mode)


# Each mode's module, which reads its checkpoints for `pyrecover ckpt` in one process
# (mode.Offline); imported where used, as above.
OFFLINE: dict[str, Callable[[], Offline]] = {
    VanillaMode.name: lambda: cast(Offline, vanilla),
    "dcp": _dcp_offline,
    "memory": _memory_offline,
}
# `pyrecover ckpt convert --to` -> the mode whose module writes that format (mode.Writer).
CONVERT_TO: dict[str, str] = {"torch": VanillaMode.name, "dcp": "dcp"}


def offline(name: str) -> Offline:
    """offline is the module that reads checkpoints of mode `name` in one process."""
    if name not in OFFLINE:
        raise CheckpointError(f"mode {name!r} is not one this version knows")
    return OFFLINE[name]()


def writer(to: str) -> Writer:
    """writer is the module that writes `convert --to` format `to`."""
    return cast(Writer, OFFLINE[CONVERT_TO[to]]())
