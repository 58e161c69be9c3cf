"""torch.compile for the trainer: whether to compile, and a compile cache that follows the run.

Inductor caches what it compiled (FX graphs, AOTAutograd graphs, C++ and Triton kernels)
under `TORCHINDUCTOR_CACHE_DIR`, by default `/tmp/torchinductor_<user>`: local to a node.
A requeued job or a restart on a spare node usually lands on another node and compiles the
whole model again before its first step. The trainer points the cache into the run
directory (`<run>/compile-cache/`, rundir.py), on the same storage as the checkpoints, so
every attempt after the first finds its kernels there. Measured on the 2-core CPU VM
(tiny.yaml, inductor with gcc): first step after the restore 16.7 s with an empty cache,
2.0 s with the run's cache. A `TORCHINDUCTOR_CACHE_DIR` the user set wins.

Inductor's cache writes are atomic (a temporary file, then a rename) and its keys hold the
torch version, the device and the graph, so ranks and nodes can share the folder, and a
restart on another kind of GPU misses instead of loading the wrong kernels.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from pyrecover.config import Config, ConfigError

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
log = logging.getLogger("pyrecover")


def compile_enabled(cfg: Config, device: torch.device, logger=None) -> bool:
    """compile_enabled: `train.compile`, where `auto` means on CUDA only (on a CPU the compile
    takes longer than the short runs made there gain), and only where a C compiler exists:
    Inductor's kernels need one at run time (the CUDA runtime images have none)."""
    wanted = cfg.train.compile == "true" or (cfg.train.compile == "auto"
                                             and device.type == "cuda")
    if not wanted or c_compiler() is not None:
        return wanted
    if cfg.train.compile == "true":
        raise ConfigError("train.compile=true needs a C compiler (cc, gcc or clang) on PATH "
                          "for torch.compile's kernels; install one or set train.compile=auto")
    if logger is not None:
        logger.warning("train.compile=auto: no C compiler on PATH, so the model runs without "
                       "torch.compile (slower); install gcc to compile it")
    return False


def c_compiler() -> str | None:
    """c_compiler is the C compiler torch.compile would find ($CC, cc, gcc, clang), or None."""
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def use_cache(folder: Path, environ: dict[str, str] | os._Environ = os.environ) -> Path:
    """use_cache makes `folder` Inductor's cache for this process, unless the user chose one
    with TORCHINDUCTOR_CACHE_DIR; returns the folder in use. Call it before torch._dynamo is
    imported (building a model on the meta device imports it): torch sets the variable itself,
    to its default under $TMPDIR, the first time it looks for its cache, which then reads here
    as the user's choice (tests/train/test_compile.py caught a run that built its model first
    and kept its kernels in $TMPDIR)."""
    chosen = environ.get(CACHE_ENV)
    if chosen:
        return Path(chosen)
    environ[CACHE_ENV] = str(folder)
    return folder


def cache_counts() -> dict[str, int]:
    """cache_counts is Inductor's FX graph cache lookups in this process so far: `hits` (a
    graph's compiled code came from the cache) and `misses` (compiled here, then stored)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # a torch without dynamo: nothing was compiled
        return {"hits": 0, "misses": 0}
    inductor: Any = counters.get("inductor", {})
    return {"hits": int(inductor.get("fxgraph_cache_hit", 0)),
            "misses": int(inductor.get("fxgraph_cache_miss", 0))}


def first_step_fields(compiled: bool, run: Any) -> dict:
    """first_step_fields: what the `first_step` phase records beside its time; for a compiled
    model, how much of the compile the cache saved (said in the log too)."""
    if not compiled:
        return {}
    counts = cache_counts()
    log.info("first step done; compile cache %s: %d graphs from the cache, %d compiled",
             os.environ.get(CACHE_ENV, run.compile_cache), counts["hits"],
             counts["misses"])
    return {"compile_cache": counts}
