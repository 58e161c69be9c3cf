"""`pyrecover bench train`: training tokens/s with each checkpoint mode against none.

`bench_train` runs the real trainer (`pyrecover.train.main`, world size 1) once per mode and
repeat, all in this process, modes interleaved so that a noisy neighbour hits them alike, and
compares steady-state throughput (tokens/s over the steps after a warm-up) with a run that
saves no checkpoint in the measured steps.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import signal
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pyrecover.bench.common import (
    MODES,
    BenchError,
    Note,
    at_least,
    machine,
    no_profile,
    num,
    quiet,
)
from pyrecover.bench.plain import plain_tokens_per_s
from pyrecover.datasource import check_source

TRAIN_MODES: dict[str, tuple[str, bool] | None] = {"none": None, **MODES}


def bench_train(config: Path | None, overrides: Sequence[str], interval: int, steps: int,
                warmup: int = 5, repeat: int = 1, modes: Sequence[str] = tuple(TRAIN_MODES),
                workdir: Path | None = None, note: Note = quiet,
                plain: bool = False, profile: int = 0,
                profile_dir: Path | None = None) -> dict[str, Any]:
    """bench_train trains `warmup + steps` steps per mode and compares tokens/s with `none`.

    `none` saves nothing within the measured steps (its interval is past the end); the final
    save every run makes after its last step is outside the measurement. With `plain`, the
    plain loop of bench/plain.py runs too, and every row says its ratio to it (`vs_plain`).
    A mode whose run fails is a row with its `error`, and the other modes still run; a failed
    `none` ends the bench (nothing to compare with). Every run of the bench shares one
    Inductor cache (unless the user set TORCHINDUCTOR_CACHE_DIR): the model compiles once,
    not once per mode. With `profile`, every run trains that many steps after the measured
    ones, which the first round records with torch.profiler (`train.profile`, profiling.py):
    its traces go to `profile_dir/<mode>/` and its figures per step into the row (`profile`).
    """
    from pyrecover import config as config_mod
    from pyrecover.config_checks import PROFILE_MOST_STEPS

    at_least(1, interval=interval, steps=steps, repeat=repeat)
    at_least(0, warmup=warmup, profile=profile)
    if profile > PROFILE_MOST_STEPS:  # (train.profile's own limit, said in bench's words)
        raise BenchError(f"--profile {profile}: at most {PROFILE_MOST_STEPS} steps")
    unknown = [m for m in modes if m not in TRAIN_MODES]
    if unknown:
        raise BenchError(f"unknown mode {unknown[0]!r}; known: {', '.join(TRAIN_MODES)}")
    modes = tuple(dict.fromkeys(modes))  # a mode named twice is one row of --repeat runs
    if "none" not in modes:
        modes = ("none", *modes)
    from pyrecover import dist

    if dist.detect(os.environ).launcher != "single":
        raise BenchError("pyrecover bench train runs one process; start it outside srun and "
                         "torchrun (unset RANK/WORLD_SIZE or SLURM_PROCID/SLURM_STEP_ID)")
    # The run logs, and so reads the device, every train.log_interval steps as the user's
    # would (loop.py: only a logged step makes the host wait for the device): the warm-up and
    # the measured steps become multiples of it, so that a logged window never mixes the two.
    given = config_mod.load(config, list(overrides))  # a bad config: said here
    no_profile(given.train.profile, " and use --profile N (steps after the measured ones, "
               "traces in --profile-dir)")
    check_source(given.data.path, given.data.column)  # and no corpus, before any run
    every = given.train.log_interval
    rounded = (-(-warmup // every) * every, -(-steps // every) * every)
    if rounded != (warmup, steps):
        note(f"train.log_interval is {every}: {rounded[0]} warm-up and {rounded[1]} measured "
             f"steps (multiples of it) instead of {warmup} and {steps}")
        warmup, steps = rounded
    measured_end = warmup + steps
    total = measured_end + profile
    # The saves _throughput counts: those at the steps warmup .. measured_end - 1.
    first = max(warmup, 1)
    in_window = (measured_end - 1) // interval - (first - 1) // interval
    unsaved = None
    if in_window <= 0 and any(TRAIN_MODES[m] is not None for m in modes):
        unsaved = (f"--interval {interval}: no save falls in the measured steps {warmup + 1}-"
                   f"{measured_end}, so the checkpoint modes' figures hold none (memory mode's "
                   f"snapshots aside); give an --interval of at most {steps}")
        note(unsaved)
    base = list(overrides) + [f"train.max_steps={total}", f"train.log_interval={every}",
                              "tracking.wandb=disabled", "checkpoint.keep=2"]
    cfg = config_mod.load(config, base)
    work = Path(tempfile.mkdtemp(prefix="pyrecover-bench-train-", dir=workdir))
    results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    profiles: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    plain_runs: list[dict[str, Any]] = []
    # Inductor sets TRITON_CACHE_DIR under its cache the first time it builds a Triton
    # kernel: both are put back, or a later compile in this process would write into `work`.
    env_before = {k: os.environ.get(k) for k in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    if not env_before["TORCHINDUCTOR_CACHE_DIR"]:  # each run's own compile-cache goes with
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(work / "compile-cache")  # its run dir
    try:
        for r in range(repeat):
            turn = r % len(modes)  # rotate, so no mode always runs first
            for name in (*modes[turn:], *modes[:turn]):
                if name in errors:
                    continue
                spec = TRAIN_MODES[name]
                extra = mode_sets(name, interval, total)
                note(f"repeat {r + 1}/{repeat}: training {total} steps with checkpoints "
                     f"{'never' if spec is None else f'every {interval} steps ({name})'}")
                run_dir = work / f"{name}-{r}"
                if profile and r == 0:
                    extra.append(f"train.profile={measured_end + 1}-{total}")
                try:
                    _train_once(config, base + extra, run_dir)
                    results[name].append(_throughput(run_dir, warmup, measured_end))
                    if profile and r == 0:
                        profiles[name] = _keep_profile(run_dir, profile_dir, name)
                except BenchError as exc:
                    if name == "none":
                        raise
                    errors[name] = str(exc)
                    note(f"{name} failed; the other modes go on: {exc}")
                shutil.rmtree(run_dir, ignore_errors=True)
            if plain:
                note(f"repeat {r + 1}/{repeat}: the plain loop, {total} steps")
                plain_runs.append(plain_tokens_per_s(cfg, steps, warmup))
    finally:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(work, ignore_errors=True)
    rows_out: list[dict[str, Any]] = []
    baseline = statistics.median(x["tokens_per_s"] for x in results["none"])
    reference = statistics.median(x["tokens_per_s"] for x in plain_runs) if plain else None
    for name in modes:
        if name in errors:
            rows_out.append({"mode": name, "error": errors[name]})
            continue
        tps = [x["tokens_per_s"] for x in results[name]]
        med = statistics.median(tps)
        mfus = [x["mfu"] for x in results[name] if x["mfu"] is not None]
        rows_out.append({
            "mode": name, "tokens_per_s": med, "min": min(tps), "max": max(tps),
            "vs_none": med / baseline, "vs_plain": med / reference if reference else None,
            "mfu": statistics.median(mfus) if mfus else None,
            "saves": statistics.median(x["saves"] for x in results[name]),
            "blocked_s": statistics.median(x["blocked_s"] for x in results[name]),
            "blocked_share": statistics.median(x["blocked_share"] for x in results[name]),
            "checkpoint_bytes": max(x["checkpoint_bytes"] for x in results[name]),
            **({"profile": profiles[name]} if name in profiles else {}),
        })
    if plain_runs:
        tps = [x["tokens_per_s"] for x in plain_runs]
        med = statistics.median(tps)
        rows_out.append({
            "mode": "plain", "tokens_per_s": med, "min": min(tps), "max": max(tps),
            "vs_none": med / baseline, "vs_plain": 1.0, "mfu": None, "saves": 0,
            "blocked_s": 0.0, "blocked_share": 0.0, "checkpoint_bytes": 0,
            "compiled": plain_runs[0]["compiled"]})
    return {"kind": "train", "config": str(config) if config else "defaults",
            "machine": machine(work.parent), "steps": steps, "warmup": warmup,
            "interval": interval, "repeat": repeat, "world_size": 1, "log_interval": every,
            **({"note": unsaved} if unsaved else {}),
            "profile_steps": profile,
            "model": config_mod.to_dict(cfg)["model"], "rows": rows_out}


def _train_once(config: Path | None, overrides: Sequence[str], run_dir: Path) -> None:
    """_train_once runs the real trainer in this process, its log captured, not shown. The
    trainer's signal handlers (which only set a stop flag) go when it returns, or a SIGTERM
    would no longer stop the bench."""
    from pyrecover import config as config_mod
    from pyrecover import preempt
    from pyrecover import train as train_mod

    cfg = config_mod.load(config, list(overrides))
    logger = logging.getLogger("pyrecover")
    saved = (logger.handlers[:], logger.level, logger.propagate)
    handlers = {sig: signal.getsignal(sig)
                for sig in {signal.SIGTERM, preempt.parse_signal(cfg.run.stop_signal)}}
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            train_mod.main(cfg, run_dir)
    except preempt.StopRequested:
        raise  # a signal (a timeout, a job's end) stops the bench, not only this mode's run
    except Exception as exc:
        tail = "\n".join(captured.getvalue().strip().splitlines()[-10:])
        raise BenchError(f"the training run in {run_dir} failed: {type(exc).__name__}: {exc}"
                         + (f"\n{tail}" if tail else "")) from exc
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def _keep_profile(run_dir: Path, into: Path | None, name: str) -> dict[str, Any]:
    """_keep_profile is the run's `profile` event, its traces copied to `into/<name>/` (the
    run directory is removed once measured; without `into` the row names no trace)."""
    from pyrecover.rundir import RunDir

    run = RunDir(run_dir)
    found = [e for e in run.read_events() if e.get("event") == "profile"]
    if not found:
        raise BenchError(f"{run.events}: the profiled run recorded no profile")
    keep = {k: v for k, v in found[-1].items() if k not in ("event", "time", "host")}
    if into is None:  # (the run directory goes once measured)
        keep.pop("trace", None)
        return keep
    target = into / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(run.profile, target)
    keep["trace"] = str(target / Path(keep["trace"]).name)
    return keep


def mode_sets(name: str, interval: int, total: int) -> list[str]:
    """mode_sets is the --set list of one mode's run of `total` steps. `none` saves nothing
    and snapshots nothing, whatever the config's mode: a memory-mode config's baseline took
    a snapshot every snapshot_interval, and every `x none` was against a slowed run."""
    spec = TRAIN_MODES[name]
    if spec is None:
        return [f"checkpoint.interval={total + 1}", f"checkpoint.snapshot_interval={total + 1}"]
    return [f"checkpoint.mode={spec[0]}", f"checkpoint.async_save={spec[1]}",
            f"checkpoint.interval={interval}"]


def _throughput(run_dir: Path, warmup: int, end: int) -> dict[str, float]:
    from pyrecover.rundir import RunDir

    run = RunDir(run_dir)
    measured = [m for m in run.read_metrics() if warmup < m.get("step", 0) <= end]
    if not measured:
        raise BenchError(f"{run.metrics}: no steps after the warm-up were logged")
    last = max(m["step"] for m in measured)
    # A row holds its window's averages: it counts for every step since the row before.
    rows = sorted(measured, key=lambda m: m["step"])
    spans = [m["step_time"] * (m["step"] - before)
             for m, before in zip(rows, [warmup] + [m["step"] for m in rows], strict=False)]
    seconds = sum(spans)
    tokens = sum(m["tokens_per_s"] * span for m, span in zip(rows, spans, strict=True))
    saves = [e for e in run.read_events()
             if e.get("event") == "checkpoint" and warmup <= e.get("step", 0) < last]
    # Every wait of the loop for a save or a snapshot (the copy, the exchange, the commit):
    # the manager's running total, read at the warm-up's end and at the last measured step.
    stall = {m["step"]: m.get("checkpoint_stall_total", 0.0) for m in run.read_metrics()}
    blocked = stall[last] - stall.get(warmup, 0.0)
    mfus = [m["mfu"] for m in measured if "mfu" in m]
    return {"tokens_per_s": tokens / seconds, "saves": len(saves), "blocked_s": blocked,
            "blocked_share": blocked / seconds,
            "mfu": statistics.median(mfus) if mfus else None,
            "checkpoint_bytes": max((e.get("bytes", 0) for e in saves), default=0)}


def format_train(report: dict[str, Any]) -> str:
    """format_train renders the training-throughput report as a table for people."""
    m = report["machine"]
    model = report["model"]
    lines = [
        f"config {report['config']}: GPT {model['n_layer']} layers x {model['n_embd']}, "
        f"{report['steps']} measured steps after {report['warmup']} warm-up, checkpoint every "
        f"{report['interval']} steps, logged every {report.get('log_interval', 1)}, world size "
        f"1; {m.get('cpu', '?')}, {m['cpus']} CPUs, "
        f"load {m['load_avg_1m']}; median of {report['repeat']}",
        "",
        "x none / x plain: tokens/s over the no-checkpoint run's / the plain loop's "
        "(bench/plain.py); blocked: every wait of the loop for saves and snapshots, in seconds "
        "and as a share of the measured time; MFU: model FLOPs over the GPU's bf16 peak",
        "",
        f"{'mode':<10} {'tokens/s (min-max)':<26} {'x none':>7} {'x plain':>8} {'MFU':>6} "
        f"{'saves':>6} {'blocked s':>10} {'blocked %':>10} {'ckpt MB':>8}",
    ]
    for r in report["rows"]:
        if r.get("error"):
            lines.append(f"{r['mode']:<10} FAILED: {r['error'].splitlines()[0]}")
            continue
        span = f"{r['tokens_per_s']:.0f} ({r['min']:.0f}-{r['max']:.0f})"
        lines.append(f"{r['mode']:<10} {span:<26} {r['vs_none']:>7.3f} "
                     f"{num(r.get('vs_plain'), 3):>8} {num(r.get('mfu'), 3):>6} "
                     f"{r['saves']:>6.0f} {r['blocked_s']:>10.3f} "
                     f"{100 * r['blocked_share']:>10.2f} {r['checkpoint_bytes'] / 1e6:>8.1f}")
    if report.get("note"):
        lines += ["", f"note: {report['note']}"]
    profiled = [r for r in report["rows"] if r.get("profile")]
    if profiled:
        from pyrecover.profiling import describe

        lines += ["", f"torch.profiler, {report['profile_steps']} steps after the measured "
                  "ones (first round), per step:"]
        lines += [f"{r['mode']:<10} {describe(r['profile'])}"
                  + (f"; {r['profile']['trace']}" if r["profile"].get("trace") else "")
                  for r in profiled]
    return "\n".join(lines)

