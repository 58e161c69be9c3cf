"""Memory mode: every few steps each rank snapshots its 1/N of the state into CPU memory and
hands a copy to a peer; the snapshots reach the disk on the disk interval, or when a rank dies.

The state (model, optimizer, as `torch.distributed.checkpoint.state_dict.get_state_dict`
names them) is seen as one flat byte string in a fixed order (the *layout*). Slice r is the
r-th of N equal byte ranges of it, whatever tensors that cuts through: balanced to the byte,
for any model and any world size, with no hand-made tables. Rank r copies slice r, and its
own packed RNG state after it, into a CPU buffer allocated once (pinned on CUDA); then it
sends that buffer over a dedicated gloo group to the `replicas - 1` ranks after it (on other
nodes when there are several) and receives theirs.

The training loop waits for the copy only, and mostly not even that (staging.py): on CUDA
the copy runs on a side stream into pinned buffers, and on CPU a large slice is copied by a
thread, during the next forward and backward; the loop's `before_update` fence makes the
optimizer's update wait for it (on CUDA the device waits, not the host). The exchange runs
in gloo's own threads; at most one is in flight, and a snapshot counts only once its
exchange finished. Each rank keeps three buffer sets (the newest complete snapshot, the one
before, the one in flight), so a kill in the middle of an exchange still leaves the survivors
one step that every slice reached.

With FSDP each rank's state is its own shards: the layout is every rank's local tensors
joined in rank order, so slice r is exactly rank r's shards (slices differ in size by what
the shards do), and a restore puts the shards together into whole tensors, which loads
under fsdp or ddp at any world size (`layout.sharded_layout`, `unflatten`).

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

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

from pyrecover import parallel
from pyrecover.checkpoint import rng, store
from pyrecover.checkpoint.memory.exchange import BACKGROUND_COPY_BYTES, Snapshots
from pyrecover.checkpoint.memory.layout import NAME, SNAP_PREFIX, Snapshot, unflatten
from pyrecover.checkpoint.memory.persist import (
    all_rngs,
    assemble,
    first_meta,
    part_files,
    write_slices,
)
from pyrecover.checkpoint.mode import Restored, WriteResult
from pyrecover.checkpoint.store import Checkpoint, Pending

log = logging.getLogger("pyrecover")
# How long a survivor waits for the exchange in flight before persisting without it.
SURVIVOR_WAIT_S = 2.0


class MemoryMode(Snapshots):
    name = NAME
    asynchronous = False

    def __init__(self, rank: int, world_size: int, device: torch.device, replicas: int = 2,
                 ranks_per_node: int | None = None,
                 background_copy_bytes: int = BACKGROUND_COPY_BYTES) -> None:
        super().__init__(rank, world_size, device, replicas, ranks_per_node,
                         background_copy_bytes)
        self._result: WriteResult | None = None

    def start(self, pending: Pending, parts, train: dict[str, Any]) -> None:
        """start writes this rank's own slice of the snapshot of this step (all ranks alive)."""
        try:
            self.wait()  # the snapshot of this step, if just taken, counts once exchanged
            if self.current.step != pending.step:
                self.snapshot(pending.step, parts, train)
                self.wait()
            files = self.write(pending.tmp, self.current, [self.rank])
            self._result = WriteResult(files)
        except OSError as exc:
            self._result = WriteResult({}, f"{type(exc).__name__}: {exc}")

    def result(self, wait: bool) -> WriteResult | None:
        return self._result

    def persist_survivor(self, root: Path) -> list[int]:
        """persist_survivor writes every slice this rank holds, of its complete snapshots, with
        no collective: the other ranks may be gone. Returns the steps written.

        The snapshot in flight gets `SURVIVOR_WAIT_S` for its copy and exchange to finish (its
        data usually arrived long ago) and then counts; if it failed or did not finish, it is
        not written: without its replica it would pass for complete here, and a copy that has
        not landed (on CUDA one queued behind the collective a peer died in never does) would
        write half-filled buffers. `current` and `previous` are complete whatever it does.
        """
        try:
            self.wait(timeout=SURVIVOR_WAIT_S)
        except Exception as exc:  # the peer it exchanged with is gone: expected here
            log.warning("rank %d: the snapshot in flight did not finish (%s: %s); persisting "
                        "the complete ones", self.rank, type(exc).__name__, exc)
        # A snapshot takes a moment to recycle its buffers; one that holds the lock longer is
        # stuck itself (in the wait for a dead peer's exchange, before it copies anything).
        held = self.persisting.acquire(timeout=SURVIVOR_WAIT_S)
        try:
            return self._persist(root)
        finally:
            if held:
                self.persisting.release()

    def _persist(self, root: Path) -> list[int]:
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
        """write puts slices `slice_ids` of `snap` and this rank's meta into `folder`."""
        return write_slices(folder, snap, slice_ids, self.rank, self.layout, self.bounds,
                            self.world_size)

    def restore(self, ckpt: Checkpoint, parts) -> Restored:
        segments, meta = assemble(ckpt.path, list(ckpt.manifest["files"]))
        model_sd, optim_state = unflatten(segments, meta["layout"], meta.get("aliases"))
        del segments  # the model's segment goes once its bytes are in the parameters
        osd = {"state": optim_state, "param_groups": meta["param_groups"]}
        # Whole tensors (a DDP run's, or an FSDP run's shards put together) into a sharded
        # model: each rank keeps its own rows of them.
        whole = parallel.is_sharded(parts.model) or any("global_shape" in e
                                                        for e in meta["layout"])
        set_state_dict(parts.model, parts.optimizer, model_state_dict=model_sd,
                       optim_state_dict=osd,
                       options=StateDictOptions(full_state_dict=True) if whole else None)
        parts.scheduler.load_state_dict(meta["scheduler"])
        rngs = meta["rngs"]
        return Restored(train=dict(meta["train"]),
                        rng=rngs[self.rank] if self.rank < len(rngs) else None)

    def close(self) -> None:
        """close lets an exchange in flight finish; its error no longer matters (every
        checkpoint this run needs was committed before)."""
        try:
            self.wait()
        except Exception as exc:
            log.debug("rank %d: the last snapshot exchange failed: %s", self.rank, exc)
        self.copier.close()


# ---------------------------------------------------- offline: `pyrecover ckpt` (mode.Offline)

def check_readable(ckpt: Checkpoint) -> None:
    names = list(ckpt.manifest["files"])
    meta = first_meta(ckpt.path, names)  # the weights-only unpickler
    meta["layout"]
    part_files(ckpt.path, names, [tuple(b) for b in meta["bounds"]])  # sizes only: not read
    for rank, saved in enumerate(all_rngs(ckpt.path, names, meta)):  # what a resume takes
        if saved is not None:  # (None: no writer held it; a resume goes on without it)
            rng.check(saved, rank)


def read_config(ckpt: Checkpoint) -> dict[str, Any]:
    return first_meta(ckpt.path, list(ckpt.manifest["files"]))["config"]


def read_model(ckpt: Checkpoint, build_model) -> dict[str, torch.Tensor]:
    segments, meta = assemble(ckpt.path, list(ckpt.manifest["files"]))
    model = unflatten(segments, meta["layout"], meta.get("aliases"))[0]
    # Views of the model's segment: torch.save would write all of it for each one. A tied
    # head stays the embedding's tensor, as in a vanilla checkpoint's model.
    clones: dict[int, torch.Tensor] = {}
    for v in model.values():
        if id(v) not in clones:
            clones[id(v)] = v.clone()
    return {k: clones[id(v)] for k, v in model.items()}


def read_all(ckpt: Checkpoint, parts) -> list[dict[str, Any]]:
    reader = MemoryMode(0, 1, torch.device("cpu"))  # no peers: reads only
    try:
        reader.restore(ckpt, parts)
    finally:
        reader.close()
    return all_rngs(ckpt.path, list(ckpt.manifest["files"]))
