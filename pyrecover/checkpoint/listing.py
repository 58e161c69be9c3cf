"""What `pyrecover ckpt ls` and `verify` show of a run's checkpoints, without torch.

Listing reads manifests and, with checksums, every file's bytes; only a checkpoint that
verifies is then opened the way a restore opens it (tools.load_problem), which needs torch.
So `ckpt ls --fast`, a run without checkpoints and a path that is no run answer at once, not
after torch's import (seconds; far more on a cluster's login node).
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from pyrecover.checkpoint import store
from pyrecover.checkpoint.store import CheckpointError
from pyrecover.rundir import RunDir


def open_run(path: str | Path) -> RunDir:
    """open_run returns the run directory at `path`, or raises naming what is wrong."""
    run = RunDir(Path(path))
    problem = run.problem()
    if problem:
        raise CheckpointError(problem)
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
    """list_checkpoints describes every step folder, newest first, verified or with its problem.

    With `checksums`, a checkpoint whose files verify must also load safely (load_problem).
    """
    now = time.time() if now is None else now
    rows = []
    recorded = _recorded_model(run) if checksums else None
    for step, folder, ckpt, problem in store.scan(run.checkpoints, checksums, steps=steps):
        if ckpt is not None and checksums:
            from pyrecover.checkpoint.tools import (  # torch: only for one to open
                load_problem,
                model_problem,
            )

            problem = load_problem(ckpt) or model_problem(ckpt, recorded)
        try:
            manifest = ckpt.manifest if ckpt else store.read_manifest(folder)
            mode, world = manifest["mode"], manifest["world_size"]
            size = sum(int(f["size"]) for f in manifest["files"].values())
            # a clock ahead (the saving node), or a save committed since `now`: not -5s
            age = max(0.0, now - float(manifest.get("time", folder.stat().st_mtime)))
        except (CheckpointError, OSError):  # (OSError: a folder this user may not read)
            mode, world, size, age = "?", "?", _du(folder), None
        rows.append(Row(step, mode, world, size, age, problem))
    return rows


def _recorded_model(run: RunDir) -> dict | None:
    """_recorded_model is run.yaml's model section, None where run.yaml does not say."""
    from pyrecover.config import ConfigError, read_yaml

    try:
        model = read_yaml(run.config)["model"]
    except (ConfigError, KeyError, TypeError):
        return None
    return model if isinstance(model, dict) else None


# What `ckpt convert --to` writes: one torch.save file, or a folder plain DCP loads.
CONVERT_TO = ("torch", "dcp")


def convert_target(to: str, out: Path, run: RunDir, replace: bool = False) -> None:
    """convert_target refuses a `--to` or an `out` that `ckpt convert` cannot write: an
    existing file `out` is replaced only with `replace` (--force) and a folder only where it
    is empty (as `export --format hf`); never the run's own files."""
    if to not in CONVERT_TO:
        raise CheckpointError(f"--to {to!r}: expected {' or '.join(CONVERT_TO)}")
    outside_checkpoints(out, run, "OUT")
    under_a_folder(out, "OUT")
    if not (out.exists() or out.is_symlink()):
        return
    real, root = Path(os.path.abspath(out)).resolve(), run.root.resolve()
    if root in real.parents:
        raise CheckpointError(f"{out} would replace {real.relative_to(root)} of the run "
                              "directory; choose a new path")
    if to == "dcp":
        if out.is_symlink() or not out.is_dir() or any(out.iterdir()):
            raise CheckpointError(f"{out} already exists and is not an empty folder; --to dcp "
                                  "writes a folder: choose a new path (nothing was written)")
    elif out.is_symlink() or not stat.S_ISREG(out.stat().st_mode):
        raise CheckpointError(f"{out} already exists and is not a regular file; --force "
                              "replaces only a file: choose a new path")
    elif not replace:
        raise CheckpointError(f"{out} already exists; choose a new path, or --force to "
                              "replace it")


def under_a_folder(out: Path, option: str) -> None:
    """under_a_folder refuses an output path below a file or a broken symbolic link (the
    folders it lacks are made)."""
    out = Path(os.path.abspath(out))
    above = next(p for p in out.parents if p.exists() or p.is_symlink())
    if not above.is_dir():
        what = "a file" if above.exists() else "a broken symbolic link"
        raise CheckpointError(f"{option} {out}: {above} is {what}, not a folder; choose a path "
                              "under a folder")


def outside_checkpoints(out: Path, run: RunDir, option: str) -> None:
    """outside_checkpoints refuses an output path in the run's checkpoints folder (through
    a symbolic link too): a file there would change a committed checkpoint, a folder would
    pass for a step that never committed."""
    checkpoints = run.checkpoints.resolve()
    real = Path(os.path.abspath(out)).resolve()
    if real == checkpoints or checkpoints in real.parents:
        raise CheckpointError(f"{option} {out} is inside the run's checkpoints folder, which "
                              "holds checkpoints only; choose a path outside it")


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
    """_du is the bytes of the files in `folder` that can be seen (a link: not walked into)."""
    total = 0
    # os.walk skips what it cannot list (a folder this user may not read)
    for parent, _, files in ([] if folder.is_symlink() else os.walk(folder)):
        for name in files:
            try:
                st = os.lstat(os.path.join(parent, name))
            except OSError:
                continue
            total += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return total
