"""The run's own files that `pyrecover status` reads beside its records: the job logs' last
error, run.yaml's name and max_steps, the checkpoint folders and persisted snapshots. Each
reader only reads."""

from __future__ import annotations

import contextlib
from typing import Any

from pyrecover.rundir import RunDir


def logged_error(run: RunDir) -> str | None:
    """logged_error is the last `error: ...` line of the newest job log, if any.

    A trainer that fails before its run directory is set up (say, a missing data file)
    exits 2 with that line on stderr but writes no event."""
    logs = sorted(run.logs.glob("*.out"), key=lambda p: p.stat().st_mtime) \
        if run.logs.is_dir() else []
    for log in reversed(logs):
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            continue
        found = next((line.removeprefix("error: ").strip() for line in reversed(lines)
                      if line.startswith("error: ")), None)
        if found:
            return found[:300]
    return None


def recorded(run: RunDir) -> tuple[str, int | None]:
    """recorded is run.yaml's (run.exp_name, train.max_steps); a run.yaml that does not read
    (damaged, hand-edited) gives the folder's name and no max_steps: status only reads, it
    never fails."""
    from pyrecover.config import ConfigError, read_yaml

    try:
        recorded = read_yaml(run.config)
    except ConfigError:
        recorded = {}
    name = run.root.name
    with contextlib.suppress(AttributeError, KeyError, TypeError):
        name = str(recorded["run"]["exp_name"]) or name
    try:
        return name, int(recorded["train"]["max_steps"])
    except (KeyError, TypeError, ValueError):
        return name, None


def persisted_snapshots(run: RunDir) -> list[int]:
    """persisted_snapshots: the steps of the `.snap-step-N` folders in checkpoints/, newest
    first."""
    from pyrecover.checkpoint.store import SNAPSHOT_GLOB

    try:
        names = [p.name.rpartition("-")[2] for p in run.checkpoints.glob(SNAPSHOT_GLOB)]
    except OSError:
        return []
    return sorted((int(n) for n in names if n.isdigit()), reverse=True)


def last_checkpoint(run: RunDir, now: float
                     ) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """last_checkpoint is the newest valid checkpoint (sizes checked) and the invalid step
    folders newer than it, each with its problem."""
    from pyrecover.checkpoint import store

    invalid = []
    for step, folder, ckpt, problem in store.scan(run.checkpoints, checksums=False):
        if ckpt is not None:  # stamped by the saving node's clock, maybe ahead: never < 0
            age = max(0.0, now - float(ckpt.manifest.get("time", now)))
            return ({"step": step, "mode": ckpt.mode, "bytes": ckpt.size, "path": str(folder),
                     "age_s": round(age, 1)}, invalid)
        invalid.append({"step": step, "path": str(folder), "problem": problem})
    return None, invalid
