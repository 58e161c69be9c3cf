"""What a run's start says about where it runs: versions, devices, layout and the SLURM job.

Rank 0 logs it at start (`describe`) and the tracker puts it into wandb's config. Imports torch
only when asked for the devices.
"""

from __future__ import annotations

import os
import platform
import socket
import time
from collections.abc import Mapping
from typing import Any

from pyrecover import config as config_mod
from pyrecover.config import Config
from pyrecover.dist import DistEnv
from pyrecover.preempt import job_end_time


def diagnostics(env: DistEnv, device: Any, environ: Mapping[str, str] = os.environ
                ) -> dict[str, Any]:
    """diagnostics describes where this job runs: versions, devices, layout, SLURM job."""
    import torch

    cuda = torch.cuda.is_available()
    nccl = "none"
    if cuda:
        try:
            version = torch.cuda.nccl.version()
            nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except (AttributeError, RuntimeError):
            nccl = "unknown"
    nodes = max(1, env.world_size // max(1, env.local_world_size))
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__.split("+")[0],
        "cuda": torch.version.cuda or "none",
        "nccl": nccl,
        "device": _device_name(torch, device),
        "gpus_per_node": torch.cuda.device_count() if cuda else 0,
        "cpus": len(os.sched_getaffinity(0)),
        "host": socket.gethostname(),
        "launcher": env.launcher,
        "world_size": env.world_size,
        # The step's nodes: with spare nodes the job holds more than the training runs on.
        "nodes": int(environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES")
                     or environ.get("SLURM_NNODES") or nodes),
        "ranks_per_node": env.local_world_size,
    }
    info.update(slurm_job(environ))
    return info


def slurm_job(environ: Mapping[str, str], now: float | None = None) -> dict[str, Any]:
    """slurm_job reads the job's id, nodes and time limit from SLURM's variables ({} outside);
    where SLURM gives no start time (22.05) the time left until the job script's
    PYRECOVER_JOB_END_TIME, at `now` (epoch seconds; the clock's by default)."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return {}
    out: dict[str, Any] = {"slurm_job_id": job,
                           "slurm_nodelist": environ.get("SLURM_JOB_NODELIST", ""),
                           "slurm_partition": environ.get("SLURM_JOB_PARTITION", ""),
                           "slurm_restart_count": int(environ.get("SLURM_RESTART_COUNT") or 0)}
    start, end = environ.get("SLURM_JOB_START_TIME"), environ.get("SLURM_JOB_END_TIME")
    if start and end and start.isdigit() and end.isdigit():
        out["slurm_time_limit"] = _hms(int(end) - int(start))
    elif (ends := job_end_time(environ)) is not None:  # SLURM 22.05: the job script's squeue
        out["slurm_time_left"] = _hms(int(ends - (now if now is not None else time.time())))
    return out


def describe(system: Mapping[str, Any], cfg: Config) -> list[str]:
    """describe renders the startup diagnostics and the resolved config as a few log lines."""
    s = system
    lines = [
        f"versions: python {s['python']}, torch {s['torch']}, CUDA {s['cuda']}, NCCL {s['nccl']}",
        f"devices: {s['device']}; {s['gpus_per_node']} GPU(s) per node, {s['cpus']} CPUs "
        f"on {s['host']}",
        f"layout: world size {s['world_size']} ({s['launcher']}), {s['nodes']} node(s) x "
        f"{s['ranks_per_node']} rank(s)",
    ]
    if "slurm_job_id" in s:
        lines.append(f"SLURM job {s['slurm_job_id']}: nodes {s['slurm_nodelist'] or '?'}, "
                     f"partition {s['slurm_partition'] or '?'}, " + (
                         f"time limit {s['slurm_time_limit']}" if "slurm_time_limit" in s else
                         f"time left {s['slurm_time_left']}" if "slurm_time_left" in s else
                         "time limit unknown") + f", restart {s['slurm_restart_count']}")
    else:
        lines.append("SLURM job: none")
    for section, values in config_mod.to_dict(cfg).items():
        lines.append(f"config {section}: " + " ".join(f"{k}={v}" for k, v in values.items()))
    return lines


def _device_name(torch: Any, device: Any) -> str:
    if getattr(device, "type", None) == "cuda":
        return f"CUDA {torch.cuda.get_device_name(device)}"
    n = torch.get_num_threads()
    return f"CPU ({n} thread{'s' if n != 1 else ''})"


def _hms(seconds: int) -> str:
    h, rest = divmod(max(0, seconds), 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"
