"""What every benchmark shares: its error, timing, repeats and medians, the machine, output.

No benchmark reaches into another's helpers; what two of them need lives here, in
`storage` (the page cache, files) or in `state` (the synthetic model and optimizer).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyrecover.slurm.submit import made_for

# A checkpoint mode joins the benchmark with one entry: its name here -> (checkpoint.mode,
# checkpoint.async_save). Everything else is driven through CheckpointManager.
MODES: dict[str, tuple[str, bool]] = {
    "vanilla": ("vanilla", False),
    "dcp-sync": ("dcp", False),
    "dcp-async": ("dcp", True),
    # At world size 1 memory mode has no peer to replicate to: this measures its disk
    # checkpoint (and, in `bench train`, its in-memory snapshots every snapshot_interval).
    "memory": ("memory", False),
}


class BenchError(ValueError):
    """The benchmark cannot run as asked (bad directory, size, mode); one line says why."""


def at_least(low: float, **flags: float) -> None:
    """at_least refuses the first of `flags` (--name=value) below `low`, naming only that one:
    `at_least(1, repeat=0)` -> "--repeat must be >= 1 (got 0)"."""
    for name, value in flags.items():
        if not value >= low:
            raise BenchError(f"--{name.replace('_', '-')} must be >= {low:g} (got {value:g})")


def no_profile(profile: str, instead: str) -> None:
    """no_profile refuses a train.profile in a bench's trainer config: the profiler's cost
    would be in what the bench times, and the traces go with its temporary runs."""
    if profile:
        raise BenchError(f"train.profile={profile} would trace the steps the bench times, and "
                         "its traces are removed with the bench's runs; leave it out (--set "
                         f"train.profile=){instead}")


def available_memory() -> int | None:
    """available_memory is what the kernel says a new allocation can take (MemAvailable), in
    bytes; None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def make_dir(path: Path, option: str = "--dir") -> Path | None:
    """make_dir creates the benchmark's folder; a path that is a file, under /proc or not
    writable is one BenchError line, not a traceback. Returns the topmost folder it created
    (for `remove_made` once the benchmark is done), None where `path` existed."""
    top = made_for(path)
    if path.exists() and not path.is_dir():  # mkdir's own word for it: "File exists"
        raise BenchError(f"{option} {path}: cannot be used (a file, not a folder); give a "
                         "writable folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".pyrecover-bench-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise BenchError(f"{option} {path}: cannot be used ({exc.strerror or exc}); give a "
                         "writable folder") from None
    return top


def remove_made(path: Path, top: Path | None) -> None:
    """remove_made removes the folders `make_dir` created, from `path` up to `top`, where they
    are empty: a benchmark that cleaned up after itself leaves no empty folder behind."""
    if top is None:
        return
    for folder in (path, *path.parents):
        try:
            folder.rmdir()
        except OSError:  # not empty (the user's own files), or gone
            return
        if folder == top:
            return


Note = Callable[[str], None]


def trainer_env(drop: tuple[str, ...] = ("PYRECOVER_",)) -> dict[str, str]:
    """trainer_env is this process's environment for a trainer a bench starts: without the
    variables named by `drop`'s prefixes (test hooks, another job's SLURM settings), except
    the user's bytecode cache setting, which belongs to the start being timed."""
    from pyrecover.startup import PYCACHE_ENV

    return {k: v for k, v in os.environ.items() if k == PYCACHE_ENV or not k.startswith(drop)}


def quiet(_: str) -> None:
    pass


@dataclass
class Samples:
    """Every repeat's figures: (method, metric) -> seconds, and the bytes each method moved."""

    seconds: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    cached: list[float] = field(default_factory=list)  # page-cache share left after each drop

    def add(self, method: str, metric: str, seconds: float) -> None:
        self.seconds.setdefault((method, metric), []).append(max(seconds, 1e-9))


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """timed runs `fn` and returns (seconds, its result), the device's queued work included."""
    sync()
    started = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - started, out


def sync() -> None:
    """sync waits for the work queued on the current CUDA device, if torch has started one."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def machine(directory: Path) -> dict[str, Any]:
    """machine describes the CPU, memory, load and the filesystem holding `directory`."""
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(),
                            "cpus": len(os.sched_getaffinity(0)),
                            "load_avg_1m": round(os.getloadavg()[0], 2)}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                info["memory_gb"] = round(int(line.split()[1]) / 1e6, 1)
                break
    except OSError:
        pass
    info.update(filesystem(directory))
    return info


def filesystem(directory: Path) -> dict[str, str]:
    """filesystem returns the mount point, type and device holding `directory` (Linux)."""
    target = str(Path(directory).resolve())
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mount, kind = line.split()[:3]
            mount = mount.replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best[0]):
                best = (mount, kind, dev)
    except OSError:
        return {}
    return {"mount": best[0], "fs_type": best[1], "device": best[2]}


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1)

