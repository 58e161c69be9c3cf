"""Memory mode: in-memory snapshots exchanged between ranks, persisted on the disk interval."""

from pyrecover.checkpoint.memory.mode import (
    NAME,
    READ_PIECE,
    SNAP_PREFIX,
    MemoryMode,
    assemble,
    coverage,
    finalize_snapshots,
    first_meta,
    holders,
    slice_bounds,
    unflatten,
)

__all__ = ["NAME", "READ_PIECE", "SNAP_PREFIX", "MemoryMode", "assemble", "coverage",
           "finalize_snapshots", "first_meta", "holders", "slice_bounds", "unflatten"]
