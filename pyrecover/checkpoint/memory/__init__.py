"""Memory mode: in-memory snapshots exchanged between ranks, persisted on the disk interval.

`layout` names things and cuts the flat state into slices (pure); `exchange` keeps the
snapshots in CPU memory and swaps replicas with peers; `persist` writes and reads the part
files and commits what survivors wrote; `mode` is the checkpoint mode built on them.
"""

from pyrecover.checkpoint.memory.layout import NAME, SNAP_PREFIX, holders, slice_bounds, unflatten
from pyrecover.checkpoint.memory.mode import MemoryMode
from pyrecover.checkpoint.memory.persist import (
    READ_PIECE,
    all_rngs,
    assemble,
    coverage,
    finalize_snapshots,
    first_meta,
)

__all__ = ["NAME", "READ_PIECE", "SNAP_PREFIX", "MemoryMode", "all_rngs", "assemble",
           "coverage", "finalize_snapshots", "first_meta", "holders", "slice_bounds",
           "unflatten"]
