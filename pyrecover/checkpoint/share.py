"""Which rank writes which tensor of a replicated (DDP) state: decided before staging.

With DDP every rank holds the whole state, and DCP's planner would give each tensor to one
rank anyway, but only after every rank had staged all of it: the whole model and optimizer
copied to host memory (pinned, on CUDA) on every rank of every node, N times the bytes the
write needs. `own_share` decides first, with the same rule as DCP (each tensor to the least
loaded rank by bytes, largest first), from the shapes alone, which every rank sees alike, so
no collective is needed; each rank then stages and writes only its share, and DCP's metadata
still lists every tensor once. Pure: no process group, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

Path_ = tuple[Any, ...]


def _leaves(state: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    if isinstance(state, dict):
        for key, value in state.items():
            yield from _leaves(value, (*path, key))
    else:
        yield path, state


def owners(state: dict[str, Any], world_size: int) -> dict[Path_, int]:
    """owners maps each leaf's path to the rank that writes it.

    Tensors sharing storage (tied weights) go to one rank together; each group goes, largest
    first, to the rank with the fewest bytes so far (the lowest on a tie); every value that
    is not a tensor (optimizer hyperparameters, counters) goes to rank 0.
    """
    groups: dict[tuple, list[Path_]] = {}
    sizes: dict[tuple, int] = {}
    out: dict[Path_, int] = {}
    for path, value in _leaves(state):
        if isinstance(value, torch.Tensor):
            # The same tensor met twice (tied weights); views into one segment stay apart.
            ident = (value.device, value.data_ptr(), value.dtype, tuple(value.shape),
                     value.stride()) if value.numel() else ("empty", path)
            groups.setdefault(ident, []).append(path)
            sizes[ident] = max(sizes.get(ident, 0), value.numel() * value.element_size())
        else:
            out[path] = 0
    load = [0] * world_size
    for ident in sorted(groups, key=lambda g: (-sizes[g], min(map(repr, groups[g])))):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        load[rank] += sizes[ident]
        for path in groups[ident]:
            out[path] = rank
    return out


def own_share(state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """own_share is `state` (nested dicts) with only the leaves `rank` writes (`owners`);
    dicts left empty stay, so the structure reads the same on every rank."""
    if world_size <= 1:
        return state
    mine = {path for path, owner in owners(state, world_size).items() if owner == rank}

    def keep(value: Any, path: Path_) -> Any:
        if isinstance(value, dict):
            kept = {k: keep(v, (*path, k)) for k, v in value.items()}
            return {k: v for k, v in kept.items() if v is not _DROP}
        return value if path in mine else _DROP

    return keep(state, ())


def replicated(state: dict[str, Any]) -> bool:
    """replicated is True when no tensor of `state` is a shard of a larger one (a DTensor,
    as FSDP's): with DDP every rank holds the same full tensors."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(v, DTensor) for _, v in _leaves(state))


_DROP = object()
