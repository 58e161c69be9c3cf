"""`pyrecover bench compile`: what torch.compile costs a restart on another node, with the
run's compile cache (compiling.py) and without it.

Each attempt is the real trainer (`pyrecover train`, one process, `train.compile=true`) in a
fresh process with a fresh TMPDIR, as on a node that never ran the job: the first attempt
trains from scratch and commits a checkpoint; then every repeat restarts the run twice, once
with the run directory's cache (what pyrecover does) and once with an empty cache (what a
new node did before), in alternating order, each training one more step. The figures are read
from the attempts' own phase events: process start and checkpoint chosen to the first step.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from pyrecover import phases
from pyrecover.bench.common import (
    BenchError,
    Note,
    at_least,
    machine,
    make_dir,
    no_profile,
    num,
    quiet,
    remove_made,
)
from pyrecover.datasource import check_source
from pyrecover.rundir import read_jsonl

CACHED, UNCACHED, FIRST = "restart, run's cache", "restart, empty cache", "first start"


def bench_compile(directory: Path, config: Path | None, overrides: list[str], repeat: int,
                  note: Note = quiet) -> dict[str, Any]:
    """bench_compile runs the attempts in a temporary folder inside `directory` (removed
    afterwards) and returns the report."""
    from pyrecover import config as config_mod

    at_least(1, repeat=repeat)
    cfg = config_mod.load(config, overrides)  # a bad config: one line, not a failed attempt
    no_profile(cfg.train.profile, "")
    check_source(cfg.data.path, cfg.data.column)  # (and no corpus: not 3 failed attempts)
    made = make_dir(Path(directory))  # made where missing, as bench ckpt and restart do
    try:
        work = Path(tempfile.mkdtemp(prefix="bench-compile-", dir=directory))
    except OSError:
        remove_made(Path(directory), made)
        raise
    try:
        rows = [_attempt(work, config, overrides, FIRST, 1, note)]
        for i in range(repeat):
            order = (CACHED, UNCACHED) if i % 2 == 0 else (UNCACHED, CACHED)
            for kind in order:
                rows.append(_attempt(work, config, overrides, kind, len(rows) + 1, note))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        remove_made(Path(directory), made)
    cached = [r["to_first_step"] for r in rows if r["attempt"] == CACHED]
    uncached = [r["to_first_step"] for r in rows if r["attempt"] == UNCACHED]
    return {"kind": "bench-compile", "machine": machine(directory), "config": str(config),
            "overrides": overrides, "repeat": repeat, "rows": rows,
            "cached_s": statistics.median(cached), "uncached_s": statistics.median(uncached),
            "cached_vs_uncached": statistics.median(cached) / statistics.median(uncached)}


def _attempt(work: Path, config: Path | None, overrides: list[str], kind: str, steps: int,
             note: Note) -> dict[str, Any]:
    node = work / f"node-{steps}"  # this attempt's /tmp: nothing left by an earlier one
    node.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    env.update({"TMPDIR": str(node), "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"})
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if kind == UNCACHED:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(node / "inductor")
    argv = [sys.executable, "-m", "pyrecover", "train"]
    argv += ["--config", str(config)] if config is not None else []
    for item in [*overrides, f"run.storage={work}", "run.exp_name=run", "train.compile=true",
                 f"train.max_steps={steps}", "tracking.wandb=disabled"]:
        argv += ["--set", item]
    note(f"attempt {steps}: {kind}")
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = " | ".join(done.stderr.strip().splitlines()[-3:])
        raise BenchError(f"attempt {steps} ({kind}) failed with exit {done.returncode}: {tail}")
    last = phases.attempts(read_jsonl(work / "run" / "events.jsonl"))[-1]
    seen = {e["phase"]: e for e in last if e.get("event") == "phase"}
    if "first_step" not in seen:
        raise BenchError(f"attempt {steps} ({kind}) recorded no first step")
    first = seen["first_step"]
    cache = first.get("compile_cache") or {}
    return {"attempt": kind, "start_to_first_step": first["time"] - seen["process_start"]["time"],
            "to_first_step": first["time"] - seen["checkpoint_chosen"]["time"],
            "hits": cache.get("hits"), "misses": cache.get("misses")}


def format_compile(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = [f"bench compile on {m.get('cpu', m['host'])} ({m['cpus']} CPUs); config "
             f"{report['config']}", "every attempt in a fresh process with a fresh TMPDIR "
             "(a node that never ran the job)", "",
             f"{'attempt':<22} {'start->1st step':>16} {'chosen->1st step':>17} "
             f"{'cache hits':>10} {'compiled':>8}"]
    for r in report["rows"]:
        lines.append(f"{r['attempt']:<22} {r['start_to_first_step']:>15.2f}s "
                     f"{r['to_first_step']:>16.2f}s {num(r['hits'], 0):>10} "
                     f"{num(r['misses'], 0):>8}")
    lines += ["", f"checkpoint chosen -> first step, restart with the run's cache vs an empty "
              f"one: {report['cached_s']:.2f}s / {report['uncached_s']:.2f}s = "
              f"{report['cached_vs_uncached']:.2f}"]
    return "\n".join(lines) + "\n"
