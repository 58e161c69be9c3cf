"""Memory mode: every few steps each rank snapshots its 1/N of the state into CPU memory and
hands a copy to a peer; the snapshots reach the disk on the disk interval, or when a rank dies.

The state (model, optimizer, as `torch.distributed.checkpoint.state_dict.get_state_dict`
names them) is seen as one flat byte string in a fixed order (the *layout*). Slice r is the
r-th of N equal byte ranges of it, whatever tensors that cuts through: balanced to the byte,
for any model and any world size, with no hand-made tables. Rank r copies slice r, and its
own packed RNG state after it, into a CPU buffer allocated once (pinned on CUDA); then it
sends that buffer over a dedicated gloo group to the `replicas - 1` ranks after it (on other
nodes when there are several) and receives theirs.

The training loop waits for the copy only, and for a large slice not even that: a thread
copies it during the next forward and backward, and the loop's `before_update` fence waits
for it before the optimizer changes the state. The exchange runs in gloo's own threads; at
most one is in flight, and a snapshot counts only once its exchange finished. Each rank keeps
three buffer sets (the newest complete snapshot, the one before, the one in flight), so a
kill in the middle of an exchange still leaves the survivors one step that every slice
reached.

On disk, a step folder holds `part-s<slice>-r<rank>.bin` files (raw bytes, written and
checksummed as in DCP mode: hashed_file.py; read straight into place on restore) and one
`meta-r<rank>.pt` per writer (layout, slice bounds, train state, scheduler, optimizer
hyper-parameters, the RNG states of the ranks whose slices it held). It is complete when its
parts cover every slice. When a peer dies, each survivor writes what it holds with no
collective at all into `checkpoints/.snap-step-<S>/`, finishing with a `done-r<rank>.json`
listing its files; the next start's rank 0 turns a snapshot folder whose parts cover every
slice into a committed `step-<S>/` (manifest last, rename), and reports and removes one that
does not.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pyrecover import faults
from pyrecover.checkpoint import rng, store
from pyrecover.checkpoint.hashed_file import HashedFile, pread_into
from pyrecover.checkpoint.store import Checkpoint, CheckpointError, Pending

NAME = "memory"
SNAP_PREFIX = ".snap-step-"
# How long a survivor waits for the exchange in flight before persisting without it.
SURVIVOR_WAIT_S = 2.0
READ_PIECE = 32 << 20  # restore reads part files in pieces of this size, several at once
# An own slice at least this big is copied by a background thread while the loop runs the next
# forward and backward; a smaller one is copied at once (starting a thread costs more).
BACKGROUND_COPY_BYTES = 64 << 20
log = logging.getLogger("pyrecover")


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


def _param_groups(optimizer: torch.optim.Optimizer, fqns: list[list[str]]) -> list[dict]:
    """_param_groups is `get_state_dict`'s `param_groups`: the hyper-parameters as they are
    now (the LR moves every step), parameters named by their fully qualified names."""
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(optimizer.param_groups, fqns, strict=True)]


def _identity(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              buffers: bool = True) -> tuple[int, ...]:
    """_identity names the storage of the live tensors a snapshot copies, in order: the
    optimizer's parameters and state, and the model's buffers when `buffers`.

    While it is unchanged, the tensors found by `get_state_dict` last time are still the live
    ones (parameters and optimizer state are updated in place); a restore, a re-created
    optimizer state or the first step's lazily created AdamW state changes it. It assumes a
    parameter the optimizer does not hold (a frozen one) is not replaced by another tensor
    during the run, and that a model without buffers at the first snapshot gets none later.
    """
    # The optimizer's flat list of parameters stands for the model's (walking the modules cost
    # 0.1 ms per snapshot of a tiny model); a parameter it does not hold is not trained.
    ptrs = [p.data_ptr() for group in optimizer.param_groups for p in group["params"]]
    ptrs += [t.data_ptr() for t in model.buffers()] if buffers else []
    for per_param in optimizer.state.values():
        ptrs += [v.data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tuple(ptrs)


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


@dataclass
class _Exchange:
    """A snapshot whose own slice is copied, its replica exchange (if any) posted to gloo and
    not yet waited for."""

    target: Snapshot
    step: int
    meta: dict[str, Any]
    works: list[Any]  # torch.distributed Work objects on `MemoryMode.group`


class MemoryMode:
    name = NAME
    asynchronous = False

    def __init__(self, rank: int, world_size: int, device: torch.device, replicas: int = 2,
                 ranks_per_node: int | None = None,
                 background_copy_bytes: int = BACKGROUND_COPY_BYTES) -> None:
        self.rank, self.world_size = rank, world_size
        self.replicas = max(1, min(replicas, world_size))
        self.ranks_per_node = ranks_per_node or world_size
        self.pin = device.type == "cuda"
        # On CUDA the copy is a device-to-host copy on the current stream, never in a thread.
        self.background_copy_bytes = background_copy_bytes if not self.pin else None
        self._copier: threading.Thread | None = None
        self._copy_error: BaseException | None = None
        # Replicas travel over their own gloo group, so they never interleave with the
        # training's collectives on the default group. Its ranks are the global ones.
        self.group = (tdist.new_group(backend="gloo")
                      if tdist.is_initialized() and world_size > 1 and self.replicas > 1
                      else None)
        # Per replica round: the rank this one sends its slice to, and the one it receives from.
        ring = [holders(s, world_size, self.replicas, self.ranks_per_node)
                for s in range(world_size)]
        self._peers = [(ring[rank][k], next(s for s in range(world_size) if ring[s][k] == rank))
                       for k in range(1, self.replicas)]
        self.layout: list[dict[str, Any]] | None = None
        self.bounds: list[tuple[int, int]] = []
        # Three buffer sets, allocated once and recycled: the newest complete snapshot, the one
        # before it, and the one being filled (or free). A kill during an exchange leaves every
        # survivor holding a step that every slice reached.
        self.current, self.previous, self.spare = Snapshot(), Snapshot(), Snapshot()
        self._inflight: _Exchange | None = None
        self._live: tuple[tuple[int, ...], list[tuple[str, torch.Tensor]], list[Any]] | None = None
        self._copies: list[tuple[int, int, torch.Tensor]] = []  # (lo, hi) in own slice <- bytes
        self._model_buffers: bool | None = None  # whether _identity must walk the modules
        self._result: tuple[dict[str, Any], str] | None = None

    # --- snapshots ----------------------------------------------------------------------

    def held_slices(self) -> list[int]:
        return [s for s in range(self.world_size)
                if self.rank in holders(s, self.world_size, self.replicas, self.ranks_per_node)]

    def snapshot(self, step: int, parts, train: dict[str, Any]) -> None:
        """snapshot copies this rank's slice of the state at `step`; replicas follow in the
        background.

        A large slice is copied by a background thread while the loop goes on with the next
        forward and backward: the loop calls `wait_staged` (through the manager's
        `before_update`) before the optimizer changes the state. A small one is copied here.
        Then the exchange with the peers is posted to gloo over `self.group` and moves in
        gloo's own threads while training goes on. At most one exchange is in flight, so this
        first waits for the previous one; a snapshot counts (becomes `current`) once its
        exchange finished, and an exchange that failed (a peer died) raises here.
        """
        self.wait_staged()
        self.wait()
        faults.maybe_kill(step, self.rank, point="snapshot")  # the previous one counted here
        tensors, fqns = self._state_tensors(parts)
        meta = {
            "train": train, "scheduler": parts.scheduler.state_dict(),
            "param_groups": _param_groups(parts.optimizer, fqns), "config": parts.config,
        }
        target = self.spare
        target.step, target.meta = -1, {}  # from here on its old contents are gone
        self._buffer(target, self.rank)
        rng.pack_into(rng.capture(), target.rngs[self.rank])
        a, b = self.bounds[self.rank]
        if self.background_copy_bytes is not None and b - a >= self.background_copy_bytes:
            self._copier = threading.Thread(target=self._copy_and_post, args=(target, step, meta),
                                            name="pyrecover-memory-copy", daemon=True)
            self._copier.start()
            return
        self._copy_and_post(target, step, meta)
        if self.group is None:  # nothing to exchange: complete now
            self.wait()

    def wait_staged(self) -> None:
        """wait_staged returns once no snapshot copy reads the live state any more."""
        copier, self._copier = self._copier, None
        if copier is not None:
            copier.join()
        error, self._copy_error = self._copy_error, None
        if error is not None:
            raise error

    def _copy_and_post(self, target: Snapshot, step: int, meta: dict[str, Any]) -> None:
        """_copy_and_post copies the own slice, then posts its exchange (in the copy thread for
        a large slice, so the exchange starts as soon as the bytes are there)."""
        try:
            self._copy_own(target)
            works = []
            if self.group is not None:
                faults.maybe_kill(step, self.rank, point="exchange")
                works = self._post_exchange(target)
            self._inflight = _Exchange(target, step, meta, works)
        except BaseException as exc:  # the loop's thread raises it from wait_staged()
            self._copy_error = exc

    def _post_exchange(self, snap: Snapshot) -> list[Any]:
        """_post_exchange starts sending this rank's slice (with its RNG state) to its peers and
        receiving theirs, without waiting: one `alltoall` per replica round, zero bytes to
        every other rank.

        It calls the process group's own `alltoall_base`: `batch_isend_irecv` spent about a
        millisecond in Python and in the caller's thread per snapshot here, a tenth of a small
        model's step, and point-to-point sends slowed the training's threads more than a
        collective, which gloo runs in its own worker thread.
        """
        assert self.group is not None
        own = snap.buffers[self.rank]
        works = []
        for dst, src in self._peers:
            out, into = [0] * self.world_size, [0] * self.world_size
            out[dst] = own.numel()
            buf = self._buffer(snap, src)
            into[src] = buf.numel()
            works.append(self.group.alltoall_base(buf, own, into, out, tdist.AllToAllOptions()))
        return works

    def wait(self, timeout: float | None = None) -> None:
        """wait finishes the exchange in flight, if any: counts its snapshot, or raises its
        error, after which its buffers are free again (as after `timeout` seconds)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        limit = None if timeout is None else timedelta(seconds=timeout)
        for work in flight.works:
            if limit is None:
                work.wait()
            else:  # a timeout closes the group's connections: for a dying process only
                work.wait(limit)
        self._count(flight.target, flight.step, flight.meta)

    def _count(self, target: Snapshot, step: int, meta: dict[str, Any]) -> None:
        target.step, target.meta = step, meta
        self.spare, self.previous, self.current = self.previous, self.current, target

    def _state_tensors(self, parts) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
        """_state_tensors returns the state's tensors in layout order and the optimizer's
        parameter names per group.

        `get_state_dict` costs about a millisecond even for a tiny model, a tenth of its
        training step; its tensors are the live ones, updated in place, so they are kept while
        `_identity` says the storage is the same, and looked up again when it is not.
        """
        if self._model_buffers is None:
            self._model_buffers = next(parts.model.buffers(), None) is not None
        key = _identity(parts.model, parts.optimizer, self._model_buffers)
        if self._live is None or self._live[0] != key:
            model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
            tensors = _flat_tensors({"model": model_sd, "optim": optim_sd})
            fqns = [list(g["params"]) for g in optim_sd["param_groups"]]
            if self.layout is None or len(self.layout) != len(tensors):
                self._plan(tensors)
            self._copies = self._plan_copies(tensors)
            for snap in (self.current, self.previous, self.spare):
                snap.copy_to = []
            contiguous = all(t.is_contiguous() for _, t in tensors)
            # A non-contiguous tensor's byte view is a copy, stale at the next step: no cache.
            self._live = (key if contiguous else (), tensors, fqns)
        return self._live[1], self._live[2]

    def _plan(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        assert self._inflight is None, "replanning under an exchange in flight"
        layout, offset = [], 0
        for key, t in tensors:
            nbytes = t.numel() * t.element_size()
            layout.append({"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                           "shape": list(t.shape), "offset": offset, "nbytes": nbytes})
            offset += nbytes
        self.layout = layout
        self.bounds = slice_bounds(offset, self.world_size)
        self.current, self.previous, self.spare = Snapshot(), Snapshot(), Snapshot()

    def _plan_copies(self, tensors: list[tuple[str, torch.Tensor]]
                     ) -> list[tuple[int, int, torch.Tensor]]:
        """_plan_copies lists the pieces of live tensors that make up this rank's slice."""
        assert self.layout is not None
        a, b = self.bounds[self.rank]
        out = []
        for entry, (_, t) in zip(self.layout, tensors, strict=True):
            lo, hi = entry["offset"], entry["offset"] + entry["nbytes"]
            if hi <= a or lo >= b:
                continue
            x, y = max(lo, a), min(hi, b)
            out.append((x - a, y - a, _as_bytes(t)[x - lo:y - lo]))
        return out

    def _buffer(self, snap: Snapshot, slice_id: int) -> torch.Tensor:
        a, b = self.bounds[slice_id]
        buf = snap.buffers.get(slice_id)
        if buf is None or buf.numel() != b - a + rng.RNG_BYTES:
            buf = torch.empty(b - a + rng.RNG_BYTES, dtype=torch.uint8, pin_memory=self.pin)
            snap.buffers[slice_id] = buf
            snap.slices[slice_id], snap.rngs[slice_id] = buf[:b - a], buf[b - a:]
            if slice_id == self.rank:
                snap.copy_to = []
        return buf

    def _copy_own(self, snap: Snapshot) -> None:
        if not snap.copy_to:
            own = snap.slices[self.rank]
            snap.copy_to = [own[lo:hi] for lo, hi, _ in self._copies]
        if snap.copy_to:  # one dispatch for every piece: 4 us per copy_ call added up
            torch._foreach_copy_(snap.copy_to, [src for _, _, src in self._copies],
                                 non_blocking=self.pin)
        if self.pin:
            torch.cuda.current_stream().synchronize()

    # --- persisting -----------------------------------------------------------------------

    def start(self, pending: Pending, parts, train: dict[str, Any]) -> None:
        """start writes this rank's own slice of the snapshot of this step (all ranks alive)."""
        try:
            self.wait_staged()
            self.wait()  # the snapshot of this step, if just taken, counts once exchanged
            if self.current.step != pending.step:
                self.snapshot(pending.step, parts, train)
                self.wait_staged()
                self.wait()
            files = self.write(pending.tmp, self.current, [self.rank])
            self._result = (files, "")
        except OSError as exc:
            self._result = ({}, f"{type(exc).__name__}: {exc}")

    def result(self, wait: bool) -> tuple[dict[str, Any], str] | None:
        return self._result

    def persist_survivor(self, root: Path) -> list[int]:
        """persist_survivor writes every slice this rank holds, of its complete snapshots, with
        no collective: the other ranks may be gone. Returns the steps written.

        The exchange in flight gets `SURVIVOR_WAIT_S` to finish (its data usually arrived long
        ago) and then counts; if it failed or did not finish, its snapshot is not written:
        without its replica it would pass for complete here.
        """
        try:
            self.wait_staged()
            self.wait(timeout=SURVIVOR_WAIT_S)
        except Exception as exc:  # the peer it exchanged with is gone: expected here
            log.debug("rank %d: the snapshot exchange in flight failed: %s", self.rank, exc)
        written = []
        for snap in (self.current, self.previous):
            if snap.step < 0:
                continue
            folder = root / f"{SNAP_PREFIX}{snap.step}"
            folder.mkdir(parents=True, exist_ok=True)
            files = self.write(folder, snap, sorted(snap.slices))
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

    def write(self, folder: Path, snap: Snapshot, slice_ids: list[int]) -> dict[str, Any]:
        """write puts slices `slice_ids` of `snap` and this rank's meta into `folder` (each
        file fsynced) and returns their sizes and checksums."""
        files: dict[str, Any] = {}
        pending = Pending(root=folder.parent, step=snap.step, tmp=folder)
        for s in slice_ids:
            name = part_name(s, self.rank)
            with HashedFile(str(folder / name)) as out:
                out.write(snap.slices[s].numpy())
                pending.files[name] = out.close()
        # Every rank's RNG state this rank holds (that of each slice's owner); `assemble`
        # merges those of all writers.
        rngs = [rng.unpack(snap.rngs[r]) if r in snap.rngs else None
                for r in range(self.world_size)]
        meta = {"step": snap.step, "layout": self.layout, "bounds": self.bounds,
                "world_size": self.world_size, **snap.meta, "rngs": rngs}
        with pending.open(meta_name(self.rank)) as f:
            torch.save(meta, f)
        files.update(pending.files)
        return files

    # --- restoring ------------------------------------------------------------------------

    def restore(self, ckpt: Checkpoint, parts):
        from pyrecover.checkpoint.manager import Restored

        segments, meta = assemble(ckpt.path, list(ckpt.manifest["files"]))
        model_sd, optim_state = unflatten(segments, meta["layout"])
        del segments  # the model's segment goes once its bytes are in the parameters
        osd = {"state": optim_state, "param_groups": meta["param_groups"]}
        set_state_dict(parts.model, parts.optimizer, model_state_dict=model_sd,
                       optim_state_dict=osd)
        parts.scheduler.load_state_dict(meta["scheduler"])
        rngs = meta["rngs"]
        return Restored(train=dict(meta["train"]),
                        rng=rngs[self.rank] if self.rank < len(rngs) else None)

    def close(self) -> None:
        """close lets an exchange in flight finish; its error no longer matters (every
        checkpoint this run needs was committed before)."""
        try:
            self.wait_staged()
            self.wait()
        except Exception as exc:
            log.debug("rank %d: the last snapshot exchange failed: %s", self.rank, exc)


def first_meta(folder: Path, names: list[str]) -> dict[str, Any]:
    """first_meta loads one writer's meta file (layout, bounds, train state, config)."""
    metas = sorted(n for n in names if n.startswith("meta-r"))
    if not metas:
        raise CheckpointError(f"{folder}: no meta-r*.pt file")
    return torch.load(folder / metas[0], weights_only=True)


def assemble(folder: Path, names: list[str]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """assemble rebuilds the state's bytes from the part files named in `names`.

    Returns (segments, meta): the flat state cut at the first optimizer tensor into two CPU
    byte tensors, model then optimizer, so that once the model's bytes are copied into the
    live parameters their memory is freed while the optimizer state keeps its views of the
    other segment (`unflatten`). Parts are read in READ_PIECE pieces by several threads
    straight into place.
    """
    meta = first_meta(folder, names)
    metas = sorted(n for n in names if n.startswith("meta-r"))
    # Each writer knows the RNG states of the slices it held; together they know every rank's.
    rngs = list(meta["rngs"])
    for name in metas[1:]:
        other = torch.load(folder / name, weights_only=True)["rngs"]
        rngs = [mine if mine is not None else theirs for mine, theirs in zip(rngs, other,
                                                                             strict=True)]
    meta["rngs"] = rngs
    bounds = [tuple(b) for b in meta["bounds"]]
    copies = {s: sorted(n for n in names if n.startswith(f"part-s{s}-r"))
              for s in range(len(bounds))}
    missing = [s for s, found in copies.items() if not found]
    if missing:
        raise CheckpointError(f"{folder}: slices {missing} are in no part file")
    for s, (a, b) in enumerate(bounds):
        size = (folder / copies[s][0]).stat().st_size
        if size != b - a:
            raise CheckpointError(f"{folder / copies[s][0]}: {size} bytes, the slice has {b - a}")
    total = bounds[-1][1]
    split = min((e["offset"] for e in meta["layout"] if e["key"].startswith("optim/")),
                default=total)
    segments = [torch.empty(split, dtype=torch.uint8), torch.empty(total - split,
                                                                   dtype=torch.uint8)]
    starts = [0, split]
    slice_starts = [a for a, _ in bounds]
    # Pieces never cross a slice's end or the split, so each lands in one segment.
    cuts = sorted({x for a, b in bounds for x in range(a, b, READ_PIECE)} | {split, total})
    pieces = [(x, y) for x, y in zip(cuts[:-1], cuts[1:], strict=True) if y > x]

    def read(piece: tuple[int, int]) -> None:
        x, y = piece
        s = bisect.bisect_right(slice_starts, x) - 1  # an empty slice shares the next start
        g = 0 if x < split else 1
        view = memoryview(segments[g].numpy())[x - starts[g]:y - starts[g]]
        path = folder / copies[s][0]
        try:
            fd = os.open(path, os.O_RDONLY)
            try:
                pread_into(fd, view, x - bounds[s][0])
            finally:
                os.close(fd)
        except OSError as exc:
            raise CheckpointError(f"{path}: {exc.strerror or exc}") from exc

    with ThreadPoolExecutor(max(1, min(4, len(pieces)))) as pool:
        list(pool.map(read, pieces))
    return segments, meta


def unflatten(segments: list[torch.Tensor], layout: list[dict[str, Any]]):
    """unflatten cuts the state into its tensors: views of the segment that holds them where
    the offset suits the dtype (no copy), else copies."""
    split = segments[0].numel()
    model: dict[str, torch.Tensor] = {}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for e in layout:
        g = 0 if e["offset"] < split else 1
        at = e["offset"] - (0 if g == 0 else split)
        raw = segments[g][at:at + e["nbytes"]]
        if at % getattr(torch, e["dtype"]).itemsize:
            raw = raw.clone()  # a view of another dtype must start at a multiple of its size
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
            try:
                ok = (path.is_file() and path.stat().st_size == info["size"]
                      and store.checksum_ok(path, info))
            except CheckpointError:  # a checksum this version does not know: unusable here
                ok = False
            if ok:
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
