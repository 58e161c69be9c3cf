"""Memory mode's pure layout: names on disk, slices of the flat state, who holds each slice,
and the snapshot buffers' shape. No I/O, no collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pyrecover.checkpoint.live import local

NAME = "memory"
SNAP_PREFIX = ".snap-step-"


def part_name(slice_id: int, rank: int) -> str:
    return f"part-s{slice_id}-r{rank}.bin"


def meta_name(rank: int) -> str:
    return f"meta-r{rank}.pt"


def slice_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """slice_bounds cuts `total` bytes into `n` ranges whose sizes differ by at most one."""
    return [(total * i // n, total * (i + 1) // n) for i in range(n)]


def holders(slice_id: int, world_size: int, replicas: int, ranks_per_node: int) -> list[int]:
    """holders lists the distinct ranks holding a slice: its own rank, then peers, on other
    nodes first.

    Round k adds the same offset to every slice (so each rank receives one slice per round):
    a node's worth of ranks times (k mod nodes), plus k // nodes. The first `nodes` holders
    are thus on distinct nodes; further replicas go to the next ranks. On one node a slice's
    replicas are the next ranks.
    """
    rpn = max(ranks_per_node, 1)
    nodes = max(1, world_size // rpn)
    offsets: list[int] = []
    k = 0
    while len(offsets) < min(replicas, world_size):
        offset = ((k % nodes) * rpn + k // nodes) % world_size
        if offset not in offsets:  # only when the nodes are not all the same size
            offsets.append(offset)
        k += 1
    return [(slice_id + offset) % world_size for offset in offsets]


def flat_tensors(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out.append((path, value))
        elif isinstance(value, dict):
            out.extend(flat_tensors(value, path + "/"))
    return out


def drop_aliases(tensors: list[tuple[str, torch.Tensor]]
                 ) -> tuple[list[tuple[str, torch.Tensor]], dict[str, str]]:
    """drop_aliases keeps the first of the keys that name the same tensor (the tied head is
    the token embedding: 14% of a tiny GPT's weights, 31% of gpt-125m's, copied twice per
    snapshot before) and maps each other key to it; `unflatten` puts them back."""
    kept: list[tuple[str, torch.Tensor]] = []
    aliases: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for key, t in tensors:
        mine = local(t)
        same = (mine.data_ptr(), mine.dtype, tuple(mine.shape), mine.stride())
        if mine.numel() and same in first:
            aliases[key] = first[same]
            continue
        first.setdefault(same, key)
        kept.append((key, t))
    return kept, aliases


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return local(t).detach().contiguous().reshape(-1).view(torch.uint8)


def sharded_layout(per_rank: list[list[dict[str, Any]]]) -> tuple[list[dict[str, Any]],
                                                                   list[tuple[int, int]]]:
    """sharded_layout joins every rank's local layout (FSDP: each rank's own shards, rows of
    the whole tensor along dim 0 in rank order) into one flat layout in which slice r is
    exactly rank r's local state: rank r snapshots all it holds and nothing else. Each shard
    entry gets the row of the whole tensor it starts at (`row`), so a restore can rebuild the
    whole tensors at any world size or under DDP."""
    layout: list[dict[str, Any]] = []
    bounds: list[tuple[int, int]] = []
    rows: dict[str, int] = {}
    offset = 0
    for rank, entries in enumerate(per_rank):
        start = offset
        for e in entries:
            e = {**e, "offset": offset, "rank": rank}
            if "global_shape" in e:
                e["row"] = rows.get(e["key"], 0)
                rows[e["key"]] = e["row"] + (e["shape"][0] if e["shape"] else 0)
            layout.append(e)
            offset += e["nbytes"]
        bounds.append((start, offset))
    return layout, bounds


@dataclass
class Snapshot:
    """Slices of one step held by this rank: its own and the replicas of its peers.

    Each slice's buffer holds the slice's bytes followed by `RNG_BYTES` for the packed RNG
    state of the rank owning the slice, so one message carries both to a replica holder.
    `step` is -1 while the buffers hold no complete snapshot: free, being copied into, or
    waiting for their replica exchange.
    """

    step: int = -1
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)  # slice id -> CPU bytes
    slices: dict[int, torch.Tensor] = field(default_factory=dict)  # views: the slice bytes
    rngs: dict[int, torch.Tensor] = field(default_factory=dict)  # views: its owner's RNG
    meta: dict[str, Any] = field(default_factory=dict)
    copy_to: list[torch.Tensor] = field(default_factory=list)  # own slice, per copy planned


def unflatten(segments: list[torch.Tensor], layout: list[dict[str, Any]],
              aliases: dict[str, str] | None = None):
    """unflatten cuts the state into its tensors: views of the segment that holds them where
    the offset suits the dtype (no copy), else copies; an FSDP run's shards are put together
    into whole tensors. Each key of `aliases` (drop_aliases) is the tensor it names."""
    split = segments[0].numel()
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    whole: dict[str, torch.Tensor] = {}  # FSDP shards' rows copied into their whole tensor
    flat: dict[str, torch.Tensor] = {}  # the whole tensors, by layout key
    for e in layout:
        g = 0 if e["offset"] < split else 1
        at = e["offset"] - (0 if g == 0 else split)
        raw = segments[g][at:at + e["nbytes"]]
        if at % getattr(torch, e["dtype"]).itemsize:
            raw = raw.clone()  # a view of another dtype must start at a multiple of its size
        t = raw.view(getattr(torch, e["dtype"])).reshape(e["shape"])
        if "global_shape" in e:
            full = whole.get(e["key"])
            if full is None:
                full = whole[e["key"]] = torch.empty(e["global_shape"], dtype=t.dtype)
            full[e["row"]:e["row"] + t.shape[0]] = t
            t = full
        flat[e["key"]] = t
    for alias, key in (aliases or {}).items():
        flat[alias] = flat[key]
    for key, t in flat.items():
        top, _, rest = key.partition("/")
        if top == "model":
            model[rest] = t
        else:  # optim/state/<fqn>/<name>
            _, _, tail = rest.partition("/")
            fqn, _, name = tail.rpartition("/")
            optim.setdefault(fqn, {})[name] = t
    return model, optim

