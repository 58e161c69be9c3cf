"""Memory mode in memory: copy this rank's slice of the state into CPU buffers and exchange
replicas with its peers over a dedicated gloo group, next to training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist
from torch.distributed.checkpoint.state_dict import get_state_dict

from pyrecover import faults
from pyrecover.checkpoint import rng
from pyrecover.checkpoint.live import identity, local, param_groups
from pyrecover.checkpoint.memory.layout import (
    Snapshot,
    as_bytes,
    drop_aliases,
    flat_tensors,
    holders,
    sharded_layout,
    slice_bounds,
)
from pyrecover.checkpoint.staging import Copier, host_buffer

log = logging.getLogger("pyrecover")
# On CPU, an own slice at least this big is copied by a background thread while the loop runs
# the next forward and backward; a smaller one is copied at once (a thread costs more).
BACKGROUND_COPY_BYTES = 64 << 20
MIN_WAIT_S = 0.002  # the shortest timeout given to a gloo work's wait (c10d: 0 is none)


@dataclass
class _Exchange:
    """A snapshot whose own slice is copied, its replica exchange (if any) posted to gloo and
    not yet waited for."""

    target: Snapshot
    step: int
    meta: dict[str, Any]
    works: list[Any]  # torch.distributed Work objects on `MemoryMode.group`


class Snapshots:
    """Snapshots keeps this rank's in-memory snapshots and their replica exchange."""

    def __init__(self, rank: int, world_size: int, device: torch.device, replicas: int = 2,
                 ranks_per_node: int | None = None,
                 background_copy_bytes: int = BACKGROUND_COPY_BYTES) -> None:
        self.rank, self.world_size = rank, world_size
        self.replicas = max(1, min(replicas, world_size))
        self.ranks_per_node = ranks_per_node or world_size
        self.pin = device.type == "cuda"
        # The own-slice copy: on CUDA always on a side stream into pinned buffers; on CPU in a
        # thread when the slice is large enough to be worth one (staging.py).
        self.copier = Copier(device)
        self.background_copy_bytes = background_copy_bytes
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
        self._own: list[dict[str, Any]] = []  # the layout's entries of this rank's tensors
        self._planned = 0  # how many live tensors the layout was planned for
        # Three buffer sets, allocated once and recycled: the newest complete snapshot, the one
        # before it, and the one being filled (or free). A kill during an exchange leaves every
        # survivor holding a step that every slice reached.
        self.current, self.previous, self.spare = Snapshot(), Snapshot(), Snapshot()
        # Held by a snapshot while it recycles a buffer set, and by a survivor's persist while
        # it writes `current` and `previous` (mode.py): a hang's persist runs in the watchdog's
        # thread, and a main thread going on past a stall must not copy into what it writes.
        self.persisting = threading.Lock()
        self._inflight: _Exchange | None = None
        self.aliases: dict[str, str] = {}  # keys left out of the layout: the tensor they name
        self._live: tuple[tuple[int, ...], list[tuple[str, torch.Tensor]], list[Any]] | None = None
        self._copies: list[tuple[int, int, torch.Tensor]] = []  # (lo, hi) in own slice <- bytes
        self._model_buffers: bool | None = None  # whether identity must walk the modules

    def held_slices(self) -> list[int]:
        return [s for s in range(self.world_size)
                if self.rank in holders(s, self.world_size, self.replicas, self.ranks_per_node)]

    def prepare(self, parts) -> None:
        """prepare lays the state out and allocates the own slice's buffer of each of the three
        snapshot sets in the copy's thread (pinned on CUDA, slow to allocate: staging.py), so
        the first snapshots do not allocate them in the loop's time."""
        self.copier.allocated()
        self._state_tensors(parts)
        sets = (self.current, self.previous, self.spare)
        self.copier.allocate(lambda: [self._buffer(s, self.rank, ahead=True) for s in sets])

    def snapshot(self, step: int, parts,
                 train: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """snapshot copies this rank's slice of the state at `step`; replicas follow in the
        background.

        The copy runs on a side stream on CUDA, and in a background thread on CPU for a large
        slice, while the loop goes on with the next forward and backward: the loop calls
        `wait_staged` (through the manager's `before_update`) before the optimizer changes the
        state. A small slice on CPU is copied here. `train` may be a function (what the loop's
        `state_later` returns): it is called once the copy is done, so the host does not wait here
        for the step's loss and gradient norm.
        Then the exchange with the peers is posted to gloo over `self.group` and moves in
        gloo's own threads while training goes on. At most one exchange is in flight, so this
        first waits for the previous one; a snapshot counts (becomes `current`) once its
        exchange finished, and an exchange that failed (a peer died) raises here.
        """
        with self.persisting:
            self._snapshot(step, parts, train)

    def _snapshot(self, step: int, parts,
                  train: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        self.copier.allocated()  # prepare's buffers are there before they are looked at
        self.wait()
        faults.maybe_kill(step, self.rank, point="snapshot")  # the previous one counted here
        tensors, fqns = self._state_tensors(parts)
        meta = {
            "train": train, "scheduler": parts.scheduler.state_dict(),
            "param_groups": param_groups(parts.optimizer, fqns), "config": parts.config,
            "aliases": dict(self.aliases),
        }
        target = self.spare
        target.step, target.meta = -1, {}  # from here on its old contents are gone
        self._buffer(target, self.rank)
        rng.pack_into(rng.capture(), target.rngs[self.rank])
        a, b = self.bounds[self.rank]
        background = self.pin or b - a >= self.background_copy_bytes
        if not target.copy_to:
            own = target.slices[self.rank]
            target.copy_to = [own[lo:hi] for lo, hi, _ in self._copies]
        # The exchange is posted once the bytes are on the host (from the copy's thread for a
        # background copy, so it starts as soon as they are there).
        self.copier.start(target.copy_to, [src for _, _, src in self._copies],
                          then=lambda: self._post(target, step, meta), background=background)
        if not background and self.group is None:  # nothing to exchange: complete now
            self.wait()

    def wait_staged(self) -> None:
        """wait_staged returns once the state may change without reaching the snapshot copy
        (on CUDA the device waits for the copy, the host does not). A failed copy or exchange
        is raised by the next `wait` (the next snapshot, save or persist)."""
        self.copier.fence()

    def device_waits(self, drain: bool = False) -> list[tuple[float, float]]:
        """device_waits: the loop's stream's waits for snapshot copies (CUDA)."""
        return self.copier.device_waits(drain)

    def _post(self, target: Snapshot, step: int, meta: dict[str, Any]) -> None:
        if callable(meta["train"]):  # the step is done on the device: its numbers are in
            meta = {**meta, "train": meta["train"]()}
        works = []
        if self.group is not None:
            faults.maybe_kill(step, self.rank, point="exchange")
            works = self._post_exchange(target)
        self._inflight = _Exchange(target, step, meta, works)

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
        """wait finishes the copy and the exchange in flight, if any: counts its snapshot, or
        raises its error, after which its buffers are free again.

        `timeout` bounds the copy and the exchange together, for a dying process only (a
        timed-out exchange closes the group's connections): past it, TimeoutError, and the
        snapshot in flight never counts. On CUDA its copy waits for the step's collectives,
        which never complete when a peer died in them.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        # The copy is on the host and its exchange posted, or this raises.
        self.copier.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        flight, self._inflight = self._inflight, None
        if flight is None:
            return
        for work in flight.works:
            if deadline is None:
                work.wait()
            else:
                # c10d reads a zero timeout, and anything under its 1 ms resolution, as none
                # at all: past the deadline a work would wait for a frozen peer for good.
                left = max(MIN_WAIT_S, deadline - time.monotonic())
                work.wait(timedelta(seconds=left))
        self._count(flight.target, flight.step, flight.meta)

    def _count(self, target: Snapshot, step: int, meta: dict[str, Any]) -> None:
        target.step, target.meta = step, meta
        self.spare, self.previous, self.current = self.previous, self.current, target

    def _state_tensors(self, parts) -> tuple[list[tuple[str, torch.Tensor]], list[Any]]:
        """_state_tensors returns the state's tensors in layout order and the optimizer's
        parameter names per group.

        `get_state_dict` costs about a millisecond even for a tiny model, a tenth of its
        training step; its tensors are the live ones, updated in place, so they are kept while
        `identity` says the storage is the same, and looked up again when it is not.
        """
        if self._model_buffers is None:
            self._model_buffers = next(parts.model.buffers(), None) is not None
        key = identity(parts.model, parts.optimizer, self._model_buffers)
        if self._live is None or self._live[0] != key:
            model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
            tensors, self.aliases = drop_aliases(flat_tensors({"model": model_sd,
                                                               "optim": optim_sd}))
            fqns = [list(g["params"]) for g in optim_sd["param_groups"]]
            if self.layout is None or self._planned != len(tensors):
                self._plan(tensors)
            self._copies = self._plan_copies(tensors)
            for snap in (self.current, self.previous, self.spare):
                snap.copy_to = []
            contiguous = all(local(t).is_contiguous() for _, t in tensors)
            # A non-contiguous tensor's byte view is a copy, stale at the next step: no cache.
            self._live = (key if contiguous else (), tensors, fqns)
        return self._live[1], self._live[2]

    def _plan(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """_plan lays the state out flat. Replicated (DDP) state: slice r is the r-th of N
        equal byte ranges. Sharded (FSDP) state: every rank's own shards, joined in rank order
        (one collective, at the same step on every rank), so slice r is all of rank r's."""
        assert self._inflight is None, "replanning under an exchange in flight"
        layout, offset = [], 0
        sharded = False
        for key, t in tensors:
            mine = local(t)
            nbytes = mine.numel() * mine.element_size()
            entry = {"key": key, "dtype": str(t.dtype).removeprefix("torch."),
                     "shape": list(mine.shape), "offset": offset, "nbytes": nbytes}
            if mine is not t:
                sharded = True
                entry["global_shape"] = list(t.shape)
            layout.append(entry)
            offset += nbytes
        self._planned = len(tensors)
        if sharded and self.world_size > 1:
            per_rank: list[Any] = [None] * self.world_size
            tdist.all_gather_object(per_rank, layout)
            self.layout, self.bounds = sharded_layout(per_rank)
            self._own = [e for e in self.layout if e["rank"] == self.rank]
        else:
            self.layout, self._own = layout, layout
            self.bounds = slice_bounds(offset, self.world_size)
        self.current, self.previous, self.spare = Snapshot(), Snapshot(), Snapshot()
        # Held by a snapshot while it recycles a buffer set, and by a survivor's persist while
        # it writes `current` and `previous` (mode.py): a hang's persist runs in the watchdog's
        # thread, and a main thread going on past a stall must not copy into what it writes.
        self.persisting = threading.Lock()

    def _plan_copies(self, tensors: list[tuple[str, torch.Tensor]]
                     ) -> list[tuple[int, int, torch.Tensor]]:
        """_plan_copies lists the pieces of live tensors that make up this rank's slice."""
        assert self.layout is not None
        a, b = self.bounds[self.rank]
        out = []
        for entry, (_, t) in zip(self._own, tensors, strict=True):
            lo, hi = entry["offset"], entry["offset"] + entry["nbytes"]
            if hi <= a or lo >= b:
                continue
            x, y = max(lo, a), min(hi, b)
            out.append((x - a, y - a, as_bytes(t)[x - lo:y - lo]))
        return out

    def _buffer(self, snap: Snapshot, slice_id: int, ahead: bool = False) -> torch.Tensor:
        a, b = self.bounds[slice_id]
        buf = snap.buffers.get(slice_id)
        if buf is None or buf.numel() != b - a + rng.RNG_BYTES:
            # Only the own slice is a device copy's target: the replicas stay unpinned, and
            # are written by gloo's threads, off the loop. `ahead`: staging.host_buffer.
            device = self.copier.device if slice_id == self.rank else torch.device("cpu")
            buf = host_buffer((b - a + rng.RNG_BYTES,), torch.uint8, device, ahead)
            snap.buffers[slice_id] = buf
            snap.slices[slice_id], snap.rngs[slice_id] = buf[:b - a], buf[b - a:]
            if slice_id == self.rank:
                snap.copy_to = []
        return buf
