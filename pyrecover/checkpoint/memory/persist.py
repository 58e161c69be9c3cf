"""Memory mode on disk: write a snapshot's slices, read a checkpoint's parts back into place,
and commit what the survivors of a dead peer wrote.
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from pyrecover.checkpoint import entries, rng, store
from pyrecover.checkpoint.hashed_file import HashedFile, pread_into
from pyrecover.checkpoint.memory.layout import NAME, SNAP_PREFIX, Snapshot, meta_name, part_name
from pyrecover.checkpoint.store import CheckpointError, Pending

log = logging.getLogger("pyrecover")
READ_PIECE = 32 << 20  # restore reads part files in pieces of this size, several at once


def write_slices(folder: Path, snap: Snapshot, slice_ids: list[int], rank: int,
                 layout: list[dict[str, Any]] | None, bounds: list[tuple[int, int]],
                 world_size: int) -> dict[str, Any]:
    """write_slices puts slices `slice_ids` of `snap` and the meta of `rank` into `folder` (each
    file fsynced) and returns their sizes and checksums."""
    files: dict[str, Any] = {}
    pending = Pending(root=folder.parent, step=snap.step, tmp=folder)
    for s in slice_ids:
        name = part_name(s, rank)
        with HashedFile(str(folder / name)) as out:
            out.write(snap.slices[s].numpy())
            pending.files[name] = out.close()
    # Every rank's RNG state this rank holds (that of each slice's owner); `assemble`
    # merges those of all writers.
    rngs = [rng.unpack(snap.rngs[r]) if r in snap.rngs else None
            for r in range(world_size)]
    meta = {"step": snap.step, "layout": layout, "bounds": bounds,
            "world_size": world_size, **snap.meta, "rngs": rngs}
    with pending.open(meta_name(rank)) as f:
        torch.save(meta, f)
    files.update(pending.files)
    return files


def first_meta(folder: Path, names: list[str]) -> dict[str, Any]:
    """first_meta loads one writer's meta file (layout, bounds, train state, config)."""
    metas = sorted(n for n in names if n.startswith("meta-r"))
    if not metas:
        raise CheckpointError(f"{folder}: no meta-r*.pt file")
    return torch.load(folder / metas[0], weights_only=True)


def all_rngs(folder: Path, names: list[str], meta: dict[str, Any] | None = None
             ) -> list[dict[str, Any] | None]:
    """all_rngs is every rank's RNG state: each writer knows those of the slices it held
    (`meta`: first_meta's, when already read)."""
    metas = sorted(n for n in names if n.startswith("meta-r"))
    rngs = list((meta or first_meta(folder, names))["rngs"])
    for name in metas[1:]:
        other = torch.load(folder / name, weights_only=True)["rngs"]
        rngs = [mine if mine is not None else theirs for mine, theirs in zip(rngs, other,
                                                                             strict=True)]
    return rngs


def part_files(folder: Path, names: list[str], bounds: list[tuple[int, int]]
               ) -> dict[int, list[str]]:
    """part_files names the part files of each slice; a CheckpointError where a slice is in
    none, or where its first has not the slice's size."""
    copies = {s: sorted(n for n in names if n.startswith(f"part-s{s}-r"))
              for s in range(len(bounds))}
    missing = [s for s, found in copies.items() if not found]
    if missing:
        raise CheckpointError(f"{folder}: slices {missing} are in no part file")
    for s, (a, b) in enumerate(bounds):
        size = (folder / copies[s][0]).stat().st_size
        if size != b - a:
            raise CheckpointError(f"{folder / copies[s][0]}: {size} bytes, the slice has {b - a}")
    return copies


def assemble(folder: Path, names: list[str]) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """assemble rebuilds the state's bytes from the part files named in `names`.

    Returns (segments, meta): the flat state cut at the first optimizer tensor into two CPU
    byte tensors, model then optimizer, so that once the model's bytes are copied into the
    live parameters their memory is freed while the optimizer state keeps its views of the
    other segment (`unflatten`). Parts are read in READ_PIECE pieces by several threads
    straight into place.
    """
    meta = first_meta(folder, names)
    meta["rngs"] = all_rngs(folder, names, meta)
    bounds = [tuple(b) for b in meta["bounds"]]
    copies = part_files(folder, names, bounds)
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


def coverage(folder: Path
             ) -> tuple[int, dict[str, Any], list[int], dict[str, Any], set[str]]:
    """coverage reads the done markers of a survivors' snapshot folder.

    Returns (step, files that verify, slices missing, meta of one writer or {}, the files
    a marker lists that do not verify).
    """
    files: dict[str, Any] = {}
    bad: set[str] = set()
    step = int(folder.name.removeprefix(SNAP_PREFIX))
    for marker in sorted(folder.glob("done-r*.json")):
        try:
            done = json.loads(marker.read_text())
        except (ValueError, RecursionError):
            continue
        listed = done.get("files") if isinstance(done, dict) else None
        if not isinstance(listed, dict):  # not a marker's shape: as good as a torn one
            continue
        for name, info in listed.items():
            if store.plain_name_problem(name) or not isinstance(info, dict):
                continue
            path = folder / name
            try:
                ok = (entries.is_file(path)  # EIO raises, not "missing"
                      and path.stat().st_size == info.get("size")
                      and store.checksum_ok(path, info))
            except CheckpointError:  # a checksum this version does not know: unusable here
                ok = False
            if ok:
                files[name] = info
            else:
                bad.add(name)
    metas = sorted(n for n in files if n.startswith("meta-r"))
    if not metas:
        return step, files, [-1], {}, bad
    meta = torch.load(folder / metas[0], weights_only=True)
    have = {int(n.split("-")[1][1:]) for n in files if n.startswith("part-s")}
    missing = [s for s in range(len(meta["bounds"])) if s not in have]
    return step, files, missing, meta, bad


def finalize_snapshots(root: Path, on_event) -> None:
    """finalize_snapshots commits the newest complete survivors' snapshot; drops the rest.

    Called by rank 0 at start, before the newest checkpoint is chosen.
    """
    snaps = []
    for p in root.glob(f"{SNAP_PREFIX}*"):
        digits = p.name.removeprefix(SNAP_PREFIX)
        if entries.is_link(p):  # never ours: its target is not touched
            p.unlink(missing_ok=True)
        elif digits.isascii() and digits.isdigit() and entries.is_real_dir(p):
            snaps.append(p)
    snaps.sort(key=lambda p: int(p.name.removeprefix(SNAP_PREFIX)), reverse=True)
    # Not only those above the newest step folder: that one may be the corrupt checkpoint the
    # run resumed past, and then this snapshot is newer than anything loadable (dropping it
    # sent the resume back a whole disk interval). The pick takes the newest that verifies.
    committed = {s for s, _ in store.committed_steps(root)}
    done = False
    for folder in snaps:
        step, files, missing, meta, bad = coverage(folder)
        if not done and step not in committed and not missing:
            pending = Pending(root=root, step=step, tmp=folder, files=files)
            final = pending.commit(NAME, int(meta["world_size"]), dict(meta["train"]),
                                   {"recovered_from": "survivors"})
            log.warning("committed the in-memory snapshot of step %d that the surviving ranks "
                        "persisted: %s", step, final)
            on_event("snapshot_recovered", step=step, path=str(final))
            done = True
            continue
        if missing and step not in committed and not done:
            torn = [s for s in missing if any(n.startswith(f"part-s{s}-") for n in bad)]
            dead = [s for s in missing if s not in torn]
            why = [f"the persisted part files of slices {torn} do not verify (truncated or "
                   "corrupt)"] * bool(torn) + [
                f"slices {dead} were held only by ranks that died"] * bool(dead)
            reason = f"the surviving ranks' snapshot of step {step} is incomplete: " + (
                "no rank's persisted files of it verify (a write that did not finish, as on a "
                "full disk)" if not meta else "; ".join(why))
            log.warning("%s; falling back to an older checkpoint", reason)
            on_event("checkpoint_invalid", step=step, path=str(folder), reason=reason)
        shutil.rmtree(folder, ignore_errors=True)

