"""`pyrecover bench memory`: what memory mode costs the training loop, at world size 2.

Two local processes join a real gloo process group (as `train --nproc 2` does: one CPU
thread each on a 2-core machine). Each builds the same GPT + AdamW state of `--size-gb`
(`state.build_state`), wraps the model in DDP and trains it on a short random batch, so the
replica exchange runs next to real DDP all-reduces. Measured, every figure `--repeat` times:

- `torch_save`: `torch.save` + fsync of the whole state by rank 0 alone (rank 1 waits): the
  baseline for the loop's wait;
- `snapshot_blocked`: how long the loop waits per snapshot (memory mode, a snapshot every
  step, replicas 2), measured on back-to-back training steps: `CheckpointManager.at_step`
  plus `before_update` (the wait, before the next optimizer step, for a copy still running);
- `exchange`: one replica exchange with nothing else running (it normally overlaps the next
  step);
- `step` / `step_snapshot`: one training step (forward, backward, DDP all-reduce, AdamW)
  without and with that snapshot;
- `persist_parallel`: both ranks write their own slice of one snapshot to `--dir` at once
  (files fsynced and hashed, as on the disk interval), until the slower one is done;
  `persist_one_writer`: rank 0 writes every slice alone (what one survivor does).

Then, in this process, the real trainer (`pyrecover train --nproc 2`, `--config`) runs
`--warmup + --steps` steps with a snapshot every `--snapshot-interval` steps (default 1) and
no disk checkpoint, and with no checkpoint at all, modes alternating over `--repeat` rounds;
tokens/s over the measured steps.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyrecover.bench.common import (
    BenchError,
    Note,
    at_least,
    available_memory,
    machine,
    make_dir,
    no_profile,
    num,
    quiet,
    remove_made,
    trainer_env,
)
from pyrecover.bench.memory_ranks import FIGURES, SEQUENCE, WORLD_SIZE, run_ranks

# The targets (README "Benchmarks"): the figure and the bound it must stay within.
TARGETS = {"blocked_vs_torch_save": ("<=", 0.05), "tokens_per_s_vs_none": (">=", 0.95)}


# --- validation ----------------------------------------------------------------------------

def _check(directory: Path, target: int, repeat: int, steps: int, warmup: int
           ) -> Path | None:
    if not target > 0:
        raise BenchError(f"--size-gb must be > 0 (got {target / 1e9:g})")
    at_least(1, repeat=repeat, steps=steps)
    at_least(0, warmup=warmup)
    from pyrecover import dist

    if dist.detect(os.environ).launcher != "single":
        raise BenchError("pyrecover bench memory starts its own 2 processes; run it outside "
                         "srun and torchrun (unset RANK/WORLD_SIZE or SLURM_PROCID/SLURM_STEP_ID)")
    if directory.exists() and not directory.is_dir():
        raise BenchError(f"--dir {directory} is not a directory")
    # Per rank: the state, DDP's gradients and buckets, three snapshot buffer sets of two
    # slices each (its own and a replica): about 5x the state; two ranks.
    needed, available = 10 * target, available_memory()
    if available is not None and available < needed:
        raise BenchError(f"{available / 1e9:.1f} GB of memory available; --size-gb "
                         f"{target / 1e9:g} needs about {needed / 1e9:.1f} GB (2 ranks)")
    made = make_dir(directory)
    free = shutil.disk_usage(directory).free
    if free < 2 * target:
        remove_made(directory, made)
        raise BenchError(f"{directory}: {free / 1e9:.1f} GB free; the benchmark needs about "
                         f"{2 * target / 1e9:.1f} GB")
    return made


# --- the two ranks -------------------------------------------------------------------------


# --- the real trainer ----------------------------------------------------------------------

TRAIN_MODES = ("none", "memory")


def mode_overrides(name: str, interval: int, total: int) -> list[str]:
    if name == "none":  # whatever the config's mode: a memory config's would snapshot
        return [f"checkpoint.snapshot_interval={total + 1}"]
    return ["checkpoint.mode=memory", f"checkpoint.snapshot_interval={interval}",
            "checkpoint.replicas=2"]


def _train_config(config: Path | None, overrides: Sequence[str], steps: int,
                  warmup: int) -> tuple[Any, list[str]]:
    """_train_config checks the trainer's config and corpus for 2 ranks; (config, --set list)."""
    from pyrecover import config as config_mod
    from pyrecover import data, dist

    total = warmup + steps
    base = list(overrides) + [f"train.max_steps={total}", "train.log_interval=1",
                              "tracking.wandb=disabled", "checkpoint.keep=2",
                              f"checkpoint.interval={total + 1}"]
    cfg = config_mod.load(config, base)
    no_profile(cfg.train.profile, "")
    config_mod.check_world_size(cfg, WORLD_SIZE)
    config_mod.check_local_gpus(cfg, WORLD_SIZE, dist.visible_gpus())
    data.check_source(cfg.data.path, cfg.data.column)
    return cfg, base


def _train_runs(config: Path | None, overrides: Sequence[str], steps: int, warmup: int,
                repeat: int, interval: int, work: Path, note: Note) -> dict[str, Any]:
    """_train_runs trains `warmup + steps` steps with `--nproc 2`, per mode and repeat."""
    from pyrecover import config as config_mod
    from pyrecover import spawn

    cfg, base = _train_config(config, overrides, steps, warmup)
    total = warmup + steps
    results: dict[str, list[dict[str, float]]] = {m: [] for m in TRAIN_MODES}
    env = trainer_env()
    for r in range(repeat):
        modes = list(TRAIN_MODES)
        turn = r % len(modes)  # rotate, so no mode always runs first
        for name in (*modes[turn:], *modes[:turn]):
            extra = mode_overrides(name, interval, total)
            note(f"repeat {r + 1}/{repeat}: pyrecover train --nproc 2, {total} steps, "
                 + (f"a snapshot every {interval} step(s)" if name != "none"
                    else "no checkpoint"))
            run_dir = work / f"train-{name}-{r}"
            argv = spawn.python_argv() + ["train", "--nproc", str(WORLD_SIZE),
                                         "--run-dir", str(run_dir)]
            if config is not None:
                argv += ["--config", str(config)]
            for item in base + extra:
                argv += ["--set", item]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                tail = "\n".join(done.stderr.strip().splitlines()[-10:])
                raise BenchError(f"the training run in {run_dir} failed (exit "
                                 f"{done.returncode}):\n{tail}")
            results[name].append(_throughput(run_dir, warmup, interval if name != "none" else 0))
            shutil.rmtree(run_dir, ignore_errors=True)
    baseline = statistics.median(x["tokens_per_s"] for x in results["none"])
    rows = []
    for name, runs in results.items():
        tps = [x["tokens_per_s"] for x in runs]
        rows.append({"mode": name, "tokens_per_s": statistics.median(tps), "min": min(tps),
                     "max": max(tps), "vs_none": statistics.median(tps) / baseline,
                     "snapshots": statistics.median(x["snapshots"] for x in runs),
                     "blocked_s_per_snapshot": statistics.median(x["blocked_per_snapshot"]
                                                                 for x in runs),
                     "blocked_share": statistics.median(x["blocked_share"] for x in runs)})
    return {"config": str(config) if config else "defaults", "steps": steps, "warmup": warmup,
            "snapshot_interval": interval, "model": config_mod.to_dict(cfg)["model"],
            "rows": rows}


def _throughput(run_dir: Path, warmup: int, interval: int) -> dict[str, float]:
    """_throughput reads tokens/s and the loop's checkpoint wait over the measured steps.

    `checkpoint_stall_total` in metrics.jsonl sums every `at_step` wait, snapshots included.
    """
    from pyrecover.rundir import RunDir

    metrics = RunDir(run_dir).read_metrics()
    measured = [m for m in metrics if m.get("step", 0) > warmup]
    before = [m for m in metrics if m.get("step", 0) == warmup]
    if not measured:
        raise BenchError(f"{run_dir}: no steps after the warm-up were logged")
    seconds = sum(m["step_time"] for m in measured)
    tokens = sum(m["tokens_per_s"] * m["step_time"] for m in measured)
    # Step k's record is written before its at_step; the stall total in the last record thus
    # covers the snapshots of steps warmup .. last - 1.
    stall = measured[-1]["checkpoint_stall_total"] - (
        before[-1]["checkpoint_stall_total"] if before else 0.0)
    last = measured[-1]["step"]
    count = sum(1 for s in range(max(warmup, 1), last) if s % interval == 0) if interval else 0
    return {"tokens_per_s": tokens / seconds, "snapshots": count,
            "blocked_per_snapshot": stall / count if count else 0.0,
            "blocked_share": stall / seconds}


# --- the report ----------------------------------------------------------------------------

def _row(name: str, values: list[float], nbytes: int = 0) -> dict[str, Any]:
    med = statistics.median(values)
    return {"figure": name, "median_s": med, "min_s": min(values), "max_s": max(values),
            "bytes": nbytes, "gb_per_s": nbytes / med / 1e9 if nbytes and med > 0 else None}


def bench_memory(directory: Path, size_gb: float = 1.0, repeat: int = 3,
                 config: Path | None = None, overrides: Sequence[str] = (), steps: int = 60,
                 warmup: int = 5, snapshot_interval: int = 1,
                 note: Note = quiet) -> dict[str, Any]:
    """bench_memory measures memory mode at world size 2 against its baselines; a report."""
    import torch

    directory = Path(directory)
    target = int(size_gb * 1e9)
    at_least(1, steps=steps, snapshot_interval=snapshot_interval)
    if snapshot_interval > steps:  # the window would hold no snapshot, its ratio "met"
        raise BenchError(f"--snapshot-interval {snapshot_interval} takes no snapshot in the "
                         f"{steps} steps measured; give --steps {snapshot_interval} or more")
    made = _check(directory, target, repeat, steps, warmup)
    try:
        _train_config(config, overrides, steps, warmup)  # a bad config or corpus fails first
        work = Path(tempfile.mkdtemp(prefix="pyrecover-bench-memory-", dir=directory))
        try:
            samples = run_ranks(target, repeat, work, note)
            train = _train_runs(config, overrides, steps, warmup, repeat, snapshot_interval,
                                work, note)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        remove_made(directory, made)
    sec = samples["seconds"]
    state_bytes, persist_bytes = samples["state_bytes"], samples["persist_bytes"]
    sizes = {"torch_save": state_bytes, "persist_parallel": persist_bytes,
             "persist_one_writer": persist_bytes, "exchange": persist_bytes // WORLD_SIZE}
    rows = [_row(f, sec[f], sizes.get(f, 0)) for f in FIGURES]
    med = {r["figure"]: r["median_s"] for r in rows}
    tps = {r["mode"]: r for r in train["rows"]}
    ratios = {
        "blocked_vs_torch_save": med["snapshot_blocked"] / med["torch_save"],
        "step_snapshot_vs_step": med["step_snapshot"] / med["step"],
        "persist_parallel_vs_one_writer": med["persist_parallel"] / med["persist_one_writer"],
        "tokens_per_s_vs_none": tps["memory"]["vs_none"],
    }
    targets = {key: {"bound": op + f" {bound:g}", "met": (ratios[key] <= bound if op == "<="
                                                          else ratios[key] >= bound)}
               for key, (op, bound) in TARGETS.items()}
    return {
        "kind": "memory", "directory": str(directory), "machine": machine(directory),
        "torch": torch.__version__.split("+")[0], "world_size": WORLD_SIZE,
        "threads_per_rank": samples["threads"], "repeat": repeat, "state_bytes": state_bytes,
        "model": samples["model"], "sequence": SEQUENCE, "rows": rows, "ratios": ratios,
        "targets": targets, "train": train,
    }


LABELS = {
    "torch_save": "torch.save + fsync, whole state, 1 rank",
    "snapshot_blocked": "snapshot: loop blocked",
    "exchange": "snapshot: replica exchange alone",
    "step": "training step, no snapshot",
    "step_snapshot": "training step + snapshot",
    "persist_parallel": "persist 1 snapshot, 2 ranks at once",
    "persist_one_writer": "persist 1 snapshot, 1 rank alone",
}
RATIO_LABELS = {
    "blocked_vs_torch_save": "loop blocked per snapshot / torch.save + fsync",
    "step_snapshot_vs_step": "training step with a snapshot / without",
    "persist_parallel_vs_one_writer": "persist by 2 ranks / by 1 rank",
    "tokens_per_s_vs_none": "tokens/s with snapshots / no checkpoint",
}


def format_memory(report: dict[str, Any]) -> str:
    """format_memory renders the memory-mode report as tables for people."""
    m, model, train = report["machine"], report["model"], report["train"]
    tm = train["model"]
    lines = [
        f"storage {report['directory']} ({m.get('fs_type', '?')} on {m.get('device', '?')}); "
        f"{m.get('cpu', '?')}, {m['cpus']} CPUs, {m.get('memory_gb', '?')} GB RAM, "
        f"load {m['load_avg_1m']}",
        f"memory mode, world size 2 (local gloo, {report['threads_per_rank']} thread(s) per "
        f"rank), state {report['state_bytes'] / 1e9:.3f} GB per rank (GPT {model['n_layer']} "
        f"layers x {model['n_embd']} wide + AdamW), a training step on {report['sequence']} "
        f"tokens, torch {report['torch']}, median of {report['repeat']} (min-max)",
        "",
        f"{'figure':<40} {'seconds (min-max)':<26} {'GB/s':>6}",
    ]
    for r in report["rows"]:
        span = f"{r['median_s']:.4f} ({r['min_s']:.4f}-{r['max_s']:.4f})"
        lines.append(f"{LABELS[r['figure']]:<40} {span:<26} {num(r['gb_per_s']):>6}")
    lines += ["", f"{'ratio':<48} {'value':>7}  target"]
    for key, value in report["ratios"].items():
        goal = report["targets"].get(key)
        verdict = f"{goal['bound']}: {'met' if goal['met'] else 'NOT met'}" if goal else ""
        lines.append(f"{RATIO_LABELS[key]:<48} {value:>7.3f}  {verdict}")
    lines += [
        "",
        f"pyrecover train --nproc 2, config {train['config']}: GPT {tm['n_layer']} layers x "
        f"{tm['n_embd']}, {train['steps']} measured steps after {train['warmup']} warm-up, a "
        f"snapshot every {train['snapshot_interval']} step(s), no disk checkpoint",
        f"{'mode':<8} {'tokens/s (min-max)':<26} {'x none':>7} {'snapshots':>10} "
        f"{'blocked ms/snapshot':>20} {'blocked %':>10}",
    ]
    for r in train["rows"]:
        span = f"{r['tokens_per_s']:.0f} ({r['min']:.0f}-{r['max']:.0f})"
        lines.append(f"{r['mode']:<8} {span:<26} {r['vs_none']:>7.3f} {r['snapshots']:>10.0f} "
                     f"{1e3 * r['blocked_s_per_snapshot']:>20.3f} "
                     f"{100 * r['blocked_share']:>10.2f}")
    return "\n".join(lines)
