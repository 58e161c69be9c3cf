"""Memory mode: every few steps each rank snapshots its 1/N of the state into CPU memory and
hands a copy to a peer; the snapshots reach the disk on the disk interval, or when a rank dies.

The state (model, optimizer, as `torch.distributed.checkpoint.state_dict.get_state_dict`
names them) is seen as one flat byte string in a fixed order (the *layout*). Slice r is the
r-th of N equal byte ranges of it, whatever tensors that cuts through: balanced to the byte,
for any model and any world size, with no hand-made tables. Rank r copies slice r into a CPU
buffer allocated once (pinned on CUDA), then sends it over a dedicated gloo group to the
`replicas - 1` ranks after it (on other nodes when there are several) and receives theirs.
Every rank keeps the last two snapshots, so a kill in the middle of an exchange still leaves
one step that every slice reached.

On disk, a step folder holds `part-s<slice>-r<rank>.bin` files (raw bytes) and one
`meta-r<rank>.pt` per writer (layout, slice bounds, train state, scheduler, optimizer
hyper-parameters, every rank's RNG states). It is complete when its parts cover every slice.
When a peer dies, each survivor writes what it holds with no collective at all into
`checkpoints/.snap-step-<S>/`, finishing with a `done-r<rank>.json` listing its files; the
next start's rank 0 turns a snapshot folder whose parts cover every slice into a committed
`step-<S>/` (manifest last, rename), and reports and removes one that does not.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pyrecover import dist
from pyrecover.checkpoint import rng, store
from pyrecover.checkpoint.store import Checkpoint, CheckpointError, Pending

NAME = "memory"
SNAP_PREFIX = ".snap-step-"
log = logging.getLogger("pyrecover")


def part_name(slice_id: int, rank: int) -> str:
    return f"part-s{slice_id}-r{rank}.bin"


def meta_name(rank: int) -> str:
    return f"meta-r{rank}.pt"


def slice_bounds(total: int, n: int) -> list[tuple[int, int]]:
    """slice_bounds cuts `total` bytes into `n` ranges whose sizes differ by at most one."""
    return [(total * i // n, total * (i + 1) // n) for i in range(n)]


def holders(slice_id: int, world_size: int, replicas: int, ranks_per_node: int) -> list[int]:
    """holders lists the ranks holding a slice: its own rank, then peers, on other nodes first.

    With several nodes the shift is one node's worth of ranks, so a replica never shares a
    node with the slice's owner; on one node it is the next rank.
    """
    nodes = max(1, world_size // max(ranks_per_node, 1))
    shift = ranks_per_node if nodes > 1 else 1
    return [(slice_id + k * shift) % world_size for k in range(min(replicas, world_size))]


def _flat_tensors(state: dict[str, Any], prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    out: list[tuple[str, torch.Tensor]] = []
    for key, value in state.items():
        path = f"{prefix}{key}"
        if isinstance(value, torch.Tensor):
            out.append((path, value))
        elif isinstance(value, dict):
            out.extend(_flat_tensors(value, path + "/"))
    return out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@dataclass
class Snapshot:
    """Slices of one step held by this rank: its own and the replicas of its peers."""

    step: int = -1
    slices: dict[int, torch.Tensor] = field(default_factory=dict)  # slice id -> CPU bytes
    meta: dict[str, Any] = field(default_factory=dict)


class MemoryMode:
    name = NAME
    asynchronous = False

    def __init__(self, rank: int, world_size: int, device: torch.device, replicas: int = 2,
                 ranks_per_node: int | None = None) -> None:
        self.rank, self.world_size = rank, world_size
        self.replicas = max(1, min(replicas, world_size))
        self.ranks_per_node = ranks_per_node or world_size
        self.pin = device.type == "cuda"
        self.group = tdist.new_group(backend="gloo") if tdist.is_initialized() else None
        self.layout: list[dict[str, Any]] | None = None
        self.bounds: list[tuple[int, int]] = []
        self.current, self.previous = Snapshot(), Snapshot()
        self._result: tuple[dict[str, Any], str] | None = None

    # --- snapshots ----------------------------------------------------------------------

    def held_slices(self) -> list[int]:
        return [s for s in range(self.world_size)
                if self.rank in holders(s, self.world_size, self.replicas, self.ranks_per_node)]

    def snapshot(self, step: int, parts, train: dict[str, Any]) -> None:
        """snapshot copies this rank's slice of the state at `step` and swaps replicas."""
        model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
        tensors = _flat_tensors({"model": model_sd, "optim": optim_sd})
        if self.layout is None or len(self.layout) != len(tensors):
            self._plan(tensors)
        meta = {
            "train": train, "scheduler": parts.scheduler.state_dict(),
            "param_groups": optim_sd["param_groups"], "config": parts.config,
            "rngs": dist.gather_objects(rng.capture(), self.world_size),
        }
        # Reuse the older snapshot's buffers for the new one: allocate once, then recycle.
        target, self.previous = self.previous, self.current
        self._copy_own(tensors, target)
        self._exchange(target)
        target.step, target.meta = step, meta
        self.current = target

    def _plan(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        layout, offset = [], 0
        for key, t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                           "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            offset += nbytes
        self.layout = layout
        self.bounds = slice_bounds(offset, self.world_size)
        self.current, self.previous = Snapshot(), Snapshot()

    def _buffer(self, snap: Snapshot, slice_id: int) -> torch.Tensor:
        a, b = self.bounds[slice_id]
        buf = snap.slices.get(slice_id)
        if buf is None or buf.numel() != b - a:
            buf = torch.empty(b - a, dtype=torch.uint8, pin_memory=self.pin)
            snap.slices[slice_id] = buf
        return buf

    def _copy_own(self, tensors: list[tuple[str, torch.Tensor]], snap: Snapshot) -> None:
        assert self.layout is not None
        a, b = self.bounds[self.rank]
        buf = self._buffer(snap, self.rank)
        for entry, (_, t) in zip(self.layout, tensors, strict=True):
            lo, hi = entry["offset"], entry["offset"] + entry["nbytes"]
            if hi <= a or lo >= b:
                continue
            x, y = max(lo, a), min(hi, b)
            buf[x - a:y - a].copy_(_as_bytes(t)[x - lo:y - lo], non_blocking=self.pin)
        if self.pin:
            torch.cuda.current_stream().synchronize()

    def _exchange(self, snap: Snapshot) -> None:
        if self.replicas < 2 or self.group is None:
            return
        own = snap.slices[self.rank]
        ops = []
        for k in range(1, self.replicas):
            dst = holders(self.rank, self.world_size, self.replicas, self.ranks_per_node)[k]
            src = next(s for s in range(self.world_size)
                       if holders(s, self.world_size, self.replicas, self.ranks_per_node)[k]
                       == self.rank)
            ops.append(tdist.P2POp(tdist.isend, own, dst, group=self.group))
            ops.append(tdist.P2POp(tdist.irecv, self._buffer(snap, src), src, group=self.group))
        for work in tdist.batch_isend_irecv(ops):
            work.wait()

    # --- persisting -----------------------------------------------------------------------

    def start(self, pending: Pending, parts, train: dict[str, Any]) -> None:
        """start writes this rank's own slice of the snapshot of this step (all ranks alive)."""
        try:
            if self.current.step != pending.step:
                self.snapshot(pending.step, parts, train)
            files = self._write(pending.tmp, self.current, [self.rank])
            self._result = (files, "")
        except OSError as exc:
            self._result = ({}, f"{type(exc).__name__}: {exc}")

    def result(self, wait: bool) -> tuple[dict[str, Any], str] | None:
        return self._result

    def persist_survivor(self, root: Path) -> list[int]:
        """persist_survivor writes every slice this rank holds, of both snapshots, with no
        collective: the other ranks may be gone. Returns the steps written."""
        written = []
        for snap in (self.current, self.previous):
            if snap.step < 0:
                continue
            folder = root / f"{SNAP_PREFIX}{snap.step}"
            folder.mkdir(parents=True, exist_ok=True)
            files = self._write(folder, snap, sorted(snap.slices))
            marker = folder / f"done-r{self.rank}.json"
            tmp = marker.with_suffix(".tmp")
            tmp.write_text(json.dumps({"step": snap.step, "rank": self.rank, "files": files,
                                       "slices": sorted(snap.slices)}))
            with tmp.open("rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, marker)
            store.fsync_dir(folder)
            written.append(snap.step)
        return written

    def _write(self, folder: Path, snap: Snapshot, slice_ids: list[int]) -> dict[str, Any]:
        files: dict[str, Any] = {}
        pending = Pending(root=folder.parent, step=snap.step, tmp=folder)
        for s in slice_ids:
            with pending.open(part_name(s, self.rank)) as f:
                f.write(memoryview(snap.slices[s].numpy()))
        meta = {"step": snap.step, "layout": self.layout, "bounds": self.bounds,
                "world_size": self.world_size, **snap.meta}
        with pending.open(meta_name(self.rank)) as f:
            torch.save(meta, f)
        files.update(pending.files)
        return files

    # --- restoring ------------------------------------------------------------------------

    def restore(self, ckpt: Checkpoint, parts):
        from pyrecover.checkpoint.manager import Restored

        flat, meta = assemble(ckpt.path, list(ckpt.manifest["files"]))
        model_sd, optim_state = unflatten(flat, meta["layout"])
        osd = {"state": optim_state, "param_groups": meta["param_groups"]}
        set_state_dict(parts.model, parts.optimizer, model_state_dict=model_sd,
                       optim_state_dict=osd)
        parts.scheduler.load_state_dict(meta["scheduler"])
        rngs = meta["rngs"]
        return Restored(train=dict(meta["train"]),
                        rng=rngs[self.rank] if self.rank < len(rngs) else None)

    def close(self) -> None:
        pass


def assemble(folder: Path, names: list[str]) -> tuple[torch.Tensor, dict[str, Any]]:
    """assemble rebuilds the flat state bytes from the part files named in `names`."""
    metas = sorted(n for n in names if n.startswith("meta-r"))
    if not metas:
        raise CheckpointError(f"{folder}: no meta-r*.pt file")
    meta = torch.load(folder / metas[0], weights_only=True)
    bounds = [tuple(b) for b in meta["bounds"]]
    flat = torch.empty(bounds[-1][1], dtype=torch.uint8)
    missing = []
    for s, (a, b) in enumerate(bounds):
        copies = sorted(n for n in names if n.startswith(f"part-s{s}-r"))
        if not copies:
            missing.append(s)
            continue
        data = (folder / copies[0]).read_bytes()
        flat[a:b] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    if missing:
        raise CheckpointError(f"{folder}: slices {missing} are in no part file")
    return flat, meta


def unflatten(flat: torch.Tensor, layout: list[dict[str, Any]]):
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for e in layout:
        raw = flat[e["offset"]:e["offset"] + e["nbytes"]].clone()
        t = raw.view(getattr(torch, e["dtype"])).reshape(e["shape"])
        top, _, rest = e["key"].partition("/")
        if top == "model":
            model[rest] = t
        else:  # optim/state/<fqn>/<name>
            _, _, tail = rest.partition("/")
            fqn, _, name = tail.rpartition("/")
            optim.setdefault(fqn, {})[name] = t
    return model, optim


def coverage(folder: Path) -> tuple[int, dict[str, Any], list[int], dict[str, Any]]:
    """coverage reads the done markers of a survivors' snapshot folder.

    Returns (step, files that verify, slices missing, meta of one writer or {}).
    """
    files: dict[str, Any] = {}
    step = int(folder.name.removeprefix(SNAP_PREFIX))
    for marker in sorted(folder.glob("done-r*.json")):
        try:
            done = json.loads(marker.read_text())
        except ValueError:
            continue
        for name, info in done["files"].items():
            path = folder / name
            if (path.is_file() and path.stat().st_size == info["size"]
                    and store.sha256_file(path) == info["sha256"]):
                files[name] = info
    metas = sorted(n for n in files if n.startswith("meta-r"))
    if not metas:
        return step, files, [-1], {}
    meta = torch.load(folder / metas[0], weights_only=True)
    have = {int(n.split("-")[1][1:]) for n in files if n.startswith("part-s")}
    missing = [s for s in range(len(meta["bounds"])) if s not in have]
    return step, files, missing, meta


def finalize_snapshots(root: Path, on_event) -> None:
    """finalize_snapshots commits the newest complete survivors' snapshot; drops the rest.

    Called by rank 0 at start, before the newest checkpoint is chosen.
    """
    snaps = sorted((p for p in root.glob(f"{SNAP_PREFIX}*") if p.is_dir()),
                   key=lambda p: int(p.name.removeprefix(SNAP_PREFIX)), reverse=True)
    newest_committed = max((s for s, _ in store.committed_steps(root)), default=-1)
    done = False
    for folder in snaps:
        step, files, missing, meta = coverage(folder)
        if not done and step > newest_committed and not missing:
            pending = Pending(root=root, step=step, tmp=folder, files=files)
            final = pending.commit(NAME, int(meta["world_size"]), dict(meta["train"]),
                                   {"recovered_from": "survivors"})
            log.warning("committed the in-memory snapshot of step %d that the surviving ranks "
                        "persisted: %s", step, final)
            on_event("snapshot_recovered", step=step, path=str(final))
            done = True
            continue
        if missing and step > newest_committed and not done:
            reason = (f"the surviving ranks' snapshot of step {step} is incomplete: slices "
                      f"{missing} were held only by ranks that died")
            log.warning("%s; falling back to the newest disk checkpoint", reason)
            on_event("checkpoint_invalid", step=step, path=str(folder), reason=reason)
        shutil.rmtree(folder, ignore_errors=True)
