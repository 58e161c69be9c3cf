"""What `pyrecover ckpt ...` does: list, verify and export the checkpoints of a run directory."""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from pyrecover.checkpoint import dcp as dcp_mode
from pyrecover.checkpoint import store, vanilla
from pyrecover.checkpoint.store import Checkpoint, CheckpointError
from pyrecover.rundir import RunDir


def open_run(path: str | Path) -> RunDir:
    """open_run returns the run directory at `path`, or raises naming what is wrong."""
    run = RunDir(Path(path))
    if not run.root.is_dir():
        raise CheckpointError(f"run directory {str(run.root)!r} does not exist")
    if not run.is_run():
        raise CheckpointError(f"{run.root} is not a pyrecover run directory (no run.yaml, "
                              "events.jsonl or checkpoints/)")
    return run


@dataclass(frozen=True)
class Row:
    step: int
    mode: str
    world_size: int | str
    size: int
    age_s: float | None
    problem: str  # "" when the checkpoint verifies

    @property
    def valid(self) -> bool:
        return not self.problem


def list_checkpoints(run: RunDir, checksums: bool = True, steps: set[int] | None = None,
                     now: float | None = None) -> list[Row]:
    """list_checkpoints describes every step folder, newest first, verified or with its problem."""
    now = time.time() if now is None else now
    rows = []
    for step, folder, ckpt, problem in store.scan(run.checkpoints, checksums):
        if steps is not None and step not in steps:
            continue
        try:
            manifest = ckpt.manifest if ckpt else store.read_manifest(folder)
            mode, world = manifest["mode"], manifest["world_size"]
            size = sum(int(f["size"]) for f in manifest["files"].values())
            age = now - float(manifest.get("time", folder.stat().st_mtime))
        except CheckpointError:
            mode, world, size, age = "?", "?", _du(folder), None
        rows.append(Row(step, mode, world, size, age, problem))
    return rows


def pick(run: RunDir, step: int | None) -> Checkpoint:
    """pick returns the checkpoint of `step` (or the newest valid one), verified."""
    if step is not None:
        folder = run.checkpoints / f"step-{step}"
        if not folder.is_dir():
            have = ", ".join(str(s) for s, _ in store.committed_steps(run.checkpoints)) or "none"
            raise CheckpointError(f"{run.root} has no checkpoint step {step} (steps: {have})")
        return store.verify(folder)
    for _, _, ckpt, _ in store.scan(run.checkpoints):
        if ckpt is not None:
            return ckpt
    raise CheckpointError(f"{run.root} has no valid checkpoint")


def model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """model_state reads the model weights of a checkpoint of any mode, in one process."""
    if ckpt.mode == vanilla.NAME:
        return dict(vanilla.load_file(ckpt)["model"])
    if ckpt.mode == dcp_mode.NAME:
        import torch.distributed.checkpoint as dcp

        from pyrecover.model import GPT, GPTConfig

        extra = json.loads((ckpt.path / dcp_mode.EXTRA_FILE).read_text())
        model = GPT(GPTConfig(**extra["config"]["model"]))
        state = {"model": model.state_dict()}
        with dcp_mode.quiet_single_process():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(ckpt.path)), no_dist=True)
        return state["model"]
    raise CheckpointError(f"{ckpt.path}: mode {ckpt.mode!r} cannot be read here")


def export_model(ckpt: Checkpoint, out: Path) -> int:
    """export_model writes the plain model state_dict of `ckpt` to `out`; returns its bytes.

    The file holds tensors only, so `torch.load(out, weights_only=True)` reads it with no
    pyrecover code. Written to a temporary name and renamed, so `out` is never half-written.
    """
    state = model_state(ckpt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, out)
    return out.stat().st_size


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def human_age(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def _du(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
