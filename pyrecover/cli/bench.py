"""`pyrecover bench ckpt|train|memory|restart|compile|gpu-check`: checkpoint speed on this
storage, its cost to training, the time an interruption and a recompile cost."""

from __future__ import annotations

import math
import signal
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli import site_options as site
from pyrecover.cli.errors import finite, folder, one_config, user_error

bench_app = typer.Typer(help="Measure checkpoints against the storage's limits, training "
                        "throughput against a plain loop, an interruption to the first resumed "
                        "step (restart), torch.compile's cost to a restart (compile), and every "
                        "GPU path (gpu-check).",
                        no_args_is_help=True)

# The choices in the metavars are written out (the CLI imports no benchmark to start);
# tests/unit/test_cli_help.py holds them to the modules that accept them.
ModeOpt = Annotated[list[str] | None, typer.Option(
    "--mode", metavar="vanilla|dcp-sync|dcp-async|memory",
    help="Checkpoint mode to measure; repeatable. Default: all.")]
GPU_CHECK_CONFIG = "launch/experiments/gpt-125m.yaml"
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the report as JSON for machines.")]


def _note(text: str) -> None:
    typer.echo(f"bench: {text}", err=True)


@bench_app.command("ckpt", short_help="Save and load speed of every mode against raw I/O "
                   "and torch.save.")
def ckpt(
    directory: Annotated[str, typer.Option(
        "--dir", metavar="<path>",
        help="Storage to measure, e.g. /scratch/$USER; a temporary folder inside "
        "it is removed afterwards (and DIR itself where the benchmark created it).")],
    size_gb: Annotated[float, typer.Option(callback=finite,
        help="Size of the synthetic model + AdamW state in GB.")] = 1.0,
    repeat: Annotated[int, typer.Option(help="Runs of every figure; the table shows the "
                                        "median, min and max.")] = 3,
    mode: ModeOpt = None,
    drop_all_caches: Annotated[bool, typer.Option(
        help="Also write /proc/sys/vm/drop_caches before cold reads (root only; drops the "
        "whole machine's page cache).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Raw I/O, torch.save/torch.load and every pyrecover mode on the same state, as ratios.

    One process (world size 1). Cold reads follow posix_fadvise(DONTNEED) of the files.
    """
    where = folder(directory, "--dir")
    from pyrecover.bench import ckpt, common

    try:
        report = ckpt.bench_ckpt(where, size_gb, repeat, tuple(mode or common.MODES),
                                 drop_all_caches, note=_note)
    except common.BenchError as exc:
        raise user_error(exc) from None
    typer.echo(common.to_json(report) if as_json else ckpt.format_ckpt(report))


@bench_app.command("train", short_help="Training tokens/s with each checkpoint mode, against none.")
def train(
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>",
        help="Experiment YAML; default: the embedded CPU demo.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one config key, e.g. --set data.path=corpus.parquet. Repeatable.")]
    = None,
    interval: Annotated[int, typer.Option(help="Checkpoint every this many steps.")] = 20,
    steps: Annotated[int, typer.Option(help="Measured steps per mode.")] = 60,
    warmup: Annotated[int, typer.Option(help="Steps before the measurement starts.")] = 5,
    repeat: Annotated[int, typer.Option(help="Runs per mode (median shown).")] = 1,
    mode: ModeOpt = None,
    plain: Annotated[bool, typer.Option(
        "--plain", help="Also time the same model as a plain hand-written loop (compiled, "
        "fused AdamW, bf16 where the trainer would be), and show each mode's ratio to it.")]
    = False,
    profile: Annotated[int, typer.Option(
        help="Train this many more steps after the measured ones and record them with "
        "torch.profiler in the first round (train.profile): per mode, the device's kernel, "
        "idle and copy time per step, and a trace for https://ui.perfetto.dev.")] = 0,
    profile_dir: Annotated[str, typer.Option(
        metavar="<path>", help="Where --profile's traces go, one folder per mode.")]
    = "runs/bench-profile",
    as_json: JsonOpt = False,
) -> None:
    """Training tokens/s with each checkpoint mode, as a ratio to no checkpoints at all.

    Runs the real trainer in this process, world size 1; every figure is a median over
    --repeat runs, and the GPU is synchronized where the clock is read. The runs log (and
    so read the GPU) every train.log_interval steps, as the config says: --warmup and
    --steps are rounded up to multiples of it.
    """
    config = one_config(configs)
    traces = folder(profile_dir, "--profile-dir")
    from pyrecover import config as config_mod
    from pyrecover.config import ConfigError

    try:  # a mistake in the config is said before the bench's imports (torch: seconds)
        config_mod.load(config, overrides or [])
    except ConfigError as exc:
        raise user_error(exc) from None
    from pyrecover.bench import common
    from pyrecover.bench import train as bench_train
    from pyrecover.datasource import DataError
    from pyrecover.preempt import StopRequested

    try:
        report = bench_train.bench_train(config, overrides or [], interval, steps, warmup,
                                         repeat, tuple(mode or bench_train.TRAIN_MODES),
                                         note=_note, plain=plain, profile=profile,
                                         profile_dir=traces.resolve())
    except (common.BenchError, ConfigError, DataError) as exc:
        raise user_error(exc) from None
    except StopRequested as stop:  # SIGTERM or the stop signal, during one of its runs
        typer.echo(f"bench train: stopped by a signal ({stop.reason}); nothing measured",
                   err=True)
        raise typer.Exit(143) from None
    typer.echo(common.to_json(report) if as_json else bench_train.format_train(report))
    failed = [r["mode"] for r in report["rows"] if r.get("error")]
    if failed:  # not the user's mistake: exit 1, like a failed run
        typer.echo(f"error: {', '.join(failed)} failed (the report says why); the other modes "
                   "were measured", err=True)
        raise typer.Exit(1)


@bench_app.command("memory", short_help="Memory mode's snapshot cost to the loop, at world size 2.")
def memory(
    directory: Annotated[str, typer.Option(
        "--dir", metavar="<path>",
        help="Storage for the persist figures and the training runs; a temporary "
        "folder inside it is removed afterwards.")],
    size_gb: Annotated[float, typer.Option(callback=finite,
        help="Size of the synthetic model + AdamW state on each rank, in GB.")] = 1.0,
    repeat: Annotated[int, typer.Option(help="Runs of every figure; the tables show the "
                                        "median, min and max.")] = 3,
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>", help="Experiment YAML for the throughput runs; "
        "default: the embedded CPU demo.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE", help="Override one config key of the throughput "
        "runs, e.g. --set data.path=corpus.parquet. Repeatable.")] = None,
    steps: Annotated[int, typer.Option(help="Measured training steps per throughput run.")]
    = 60,
    warmup: Annotated[int, typer.Option(help="Steps before the measurement starts.")] = 5,
    snapshot_interval: Annotated[int, typer.Option(
        help="Steps between snapshots in the throughput runs.")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Memory mode at world size 2 (2 local processes): the loop's wait per snapshot, persist
    by 2 ranks vs 1, and training tokens/s with a snapshot every step, as ratios."""
    where, config = folder(directory, "--dir"), one_config(configs)
    from pyrecover.bench import common, memory
    from pyrecover.config import ConfigError
    from pyrecover.datasource import DataError

    try:
        report = memory.bench_memory(where, size_gb, repeat, config, overrides or [],
                                           steps, warmup, snapshot_interval, note=_note)
    except (common.BenchError, ConfigError, DataError) as exc:
        raise user_error(exc) from None
    typer.echo(common.to_json(report) if as_json else memory.format_memory(report))


@bench_app.command("restart", short_help="Time from a signal or crash to the first resumed step.")
def restart(
    directory: Annotated[str, typer.Option(
        "--dir", metavar="<path>",
        help="run.storage of the benchmark's job (shared with the compute nodes); "
        "its run directory bench-restart-<id> is left there for inspection.")],
    cluster: Annotated[str | None, typer.Option(  # text: an empty one is not the Path '.'
        metavar="<path>", help="Cluster profile YAML, as for launch (default: launch's). The "
        "cluster itself is the one SLURM's commands reach (SLURM_CONF).")] = None,
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>",
        help="Experiment YAML to train (e.g. launch/experiments/tiny.yaml).")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one experiment key, e.g. --set data.path=c.parquet. Repeatable.")]
    = None,
    nodes: Annotated[int | None, typer.Option(help="Nodes (launch --nodes).")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(
        help="Tasks per node (launch --gpus-per-node).")] = None,
    launcher: Annotated[str | None, typer.Option(metavar=site.LAUNCHERS,
                                                  help="launch --launcher.")] = None,
    spare_nodes: Annotated[int | None, typer.Option(
        help="launch --spare-nodes: a crash then restarts inside the allocation, with no "
        "requeue (compare with the same bench without it).")] = None,
    time_limit: Annotated[str | None, typer.Option(
        "--time", help="The job's time limit (launch --time); long enough for every cycle.")]
    = None,
    interrupt: Annotated[list[str] | None, typer.Option(
        "--interrupt", metavar="signal|crash", help="signal (scancel --signal=USR2) or crash "
        "(the last rank SIGKILLs itself); repeatable. Default: both.")] = None,
    repeat: Annotated[int, typer.Option(help="Interruptions of each kind (one job, "
                                        "requeued each time); medians shown.")] = 3,
    state_gb: Annotated[float | None, typer.Option(callback=finite,
        help="Train a 4-layer GPT whose weights + AdamW state are about this many GB "
        "instead of the config's model.")] = None,
    timeout: Annotated[float, typer.Option(callback=finite,
        help="Seconds to wait for any one event (a start, a resumed step).")] = 600.0,
    local: Annotated[bool, typer.Option(
        "--local", help="No SLURM: run `pyrecover train --nproc N` here and restart it at "
        "once after each interruption (the bench plays the job script), to time everything "
        "but SLURM's part on a machine without a cluster.")] = False,
    nproc: Annotated[int | None, typer.Option(
        help="With --local: trainer processes (the world size); default 2.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Signal or crash to the first resumed step of a real job, phase by phase, minus the
    cluster's requeue delay (read from SLURM's job times).

    Submits one job with `pyrecover launch`, interrupts it --repeat times per kind, waits on
    its events for each resume, then cancels it. `make bench-restart` runs it on a throwaway
    local SLURM cluster. With --local there is no job: e.g. `pyrecover bench restart --local
    --nproc 2 --dir /tmp/b --config launch/experiments/tiny.yaml --set train.device=cpu`.
    """
    where, config = folder(directory, "--dir"), one_config(configs)
    from pyrecover.bench import common
    from pyrecover.bench import restart as bench_restart
    from pyrecover.slurm.profile import find_profile

    profile = None if cluster is None else find_profile(cluster, {}, Path.home())

    launch_args: list[str] = []
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node),
                        ("--launcher", launcher), ("--spare-nodes", spare_nodes),
                        ("--time", time_limit)):
        launch_args += [flag, str(value)] if value is not None else []
    job_only = launch_args[::2] + (["--cluster"] if cluster is not None else [])
    if local and job_only:
        raise user_error(f"{', '.join(job_only)}: for a SLURM job; --local runs without one "
                         "(--nproc sets its world size)")
    if nproc is not None and not local:
        raise user_error("--nproc is for --local; a job's processes are --nodes x "
                         "--gpus-per-node")
    kinds = tuple(dict.fromkeys(interrupt or bench_restart.KINDS))  # --repeat per kind, once
    # A SIGTERM (gpu-check's step timeout, a job's end) must reach the `finally` that stops the
    # trainer the bench started in a session of its own, or that trainer outlives the bench.
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if local:
            from pyrecover.bench import restart_local

            report = restart_local.bench_restart_local(
                where, config, overrides or [], 2 if nproc is None else nproc, kinds,
                repeat, state_gb, timeout, note=_note)
            text = restart_local.format_local
        else:
            report = bench_restart.bench_restart(
                where, profile, config, overrides or [], launch_args, kinds, repeat,
                state_gb, timeout, note=_note)
            text = bench_restart.format_restart
    except common.BenchError as exc:
        raise user_error(exc) from None
    finally:
        signal.signal(signal.SIGTERM, before)
    typer.echo(common.to_json(report) if as_json else text(report))


@bench_app.command("compile", short_help="torch.compile's cost to a restart, with and "
                   "without its cache.")
def compile_(
    directory: Annotated[str, typer.Option(
        "--dir", metavar="<path>",
        help="Storage for the run (as run.storage would be); a temporary folder "
        "inside it is removed afterwards.")],
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>",
        help="Experiment YAML; default: the embedded CPU demo.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one config key, e.g. --set data.path=corpus.parquet. Repeatable.")]
    = None,
    repeat: Annotated[int, typer.Option(help="Restarts of each kind (median shown).")] = 2,
    as_json: JsonOpt = False,
) -> None:
    """torch.compile's cost to a restart on a new node: the first step after a restart with
    the run's compile cache vs an empty one, as a ratio.

    Every attempt is `pyrecover train` with train.compile=true in a fresh process and TMPDIR,
    one step each; compiling needs a C compiler (and on a GPU, Triton).
    """
    where, config = folder(directory, "--dir"), one_config(configs)
    from pyrecover.bench import common
    from pyrecover.bench import compile as bench_compile
    from pyrecover.config import ConfigError
    from pyrecover.datasource import DataError

    try:
        report = bench_compile.bench_compile(where, config, overrides or [], repeat,
                                             note=_note)
    except (common.BenchError, ConfigError, DataError) as exc:
        raise user_error(exc) from None
    typer.echo(common.to_json(report) if as_json else bench_compile.format_compile(report))


@bench_app.command("gpu-check", short_help="Every GPU path on this machine in one report.")
def gpu_check(
    out: Annotated[str, typer.Option(
        metavar="<path>", help="Folder for report.txt, report.json and the logs.")]
    = "runs/gpu-check",
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>",
        help=f"Experiment YAML to train.  [default: {GPU_CHECK_CONFIG}]")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one config key of the training runs. Repeatable.")] = None,
    steps: Annotated[int, typer.Option(help="Measured training steps per mode.")] = 30,
    warmup: Annotated[int, typer.Option(help="Steps before the measurement (compilation).")]
    = 5,
    interval: Annotated[int, typer.Option(help="Checkpoint every this many steps.")] = 15,
    size_gb: Annotated[float, typer.Option(
        callback=finite, help="State size for bench ckpt, in GB.")] = 2.0,
    tests: Annotated[bool, typer.Option(help="Run tests/gpu first.")] = True,
    allow_cpu: Annotated[bool, typer.Option(
        help="Run without a GPU (to try the check itself; its figures mean nothing).")] = False,
    only: Annotated[list[str] | None, typer.Option(
        "--only", metavar="STEP", help="Run only this step (repeatable, run in the order "
        "given): tests, train, memory-every-step, ckpt, memory-cpu, compile, restart-cpu, "
        "restart-cpu-4, restart-cpu-1gb, restart-gpu. The report keeps the other steps of an "
        "earlier report in --out from the same GPU.")] = None,
    cpu_repeat: Annotated[int, typer.Option(
        help="Rounds of the benches on the CPU cores: bench memory's (memory-cpu), and "
        "interruptions of each kind in the restart steps.")] = 2,
    cpu_state_gb: Annotated[float, typer.Option(callback=finite,
        help="The state of memory-cpu and restart-cpu-1gb, in GB (the issues bound 1 GB).")]
    = 1.0,
    cpu_steps: Annotated[int, typer.Option(
        min=1, help="Measured training steps of each throughput run of memory-cpu (bench "
        "memory's --steps); fewer try the check quickly, with figures that mean less.")] = 60,
    step_timeout: Annotated[float, typer.Option(callback=finite,
        help="Seconds one step may take; past it the step is stopped (SIGTERM, then SIGKILL), "
        "reported as failed, and the check goes on with the next; 0: no limit.")] = 1800.0,
    rounds: Annotated[int, typer.Option(
        min=1, help="Runs of each mode in the GPU's training steps (train, memory-every-step), "
        "in a rotated order, medians: one run of a mode is about 4% apart from the next on "
        "an H200, as far as some ratios are from their bounds.")] = 1,
    budget: Annotated[float, typer.Option(callback=finite,
        help="Seconds the whole check may take (a lease's minutes): a step starts only with "
        "60 s of it left and is stopped 20 s before it runs out; the steps not run are "
        "listed, with the --only to run them next time. 0: no budget.")] = 0.0,
) -> None:
    """Every GPU path on this machine in one report: tests/gpu, bench train (all modes, memory
    with a snapshot every step, the plain compiled loop), bench ckpt, bench memory (on the CPU
    cores), bench compile, bench restart --local (CPU at world sizes 2 and 4, and the GPU);
    bounds checked.

    Needs a CUDA build of torch, typer, pyyaml and pyarrow, and this package (`pip install
    --no-deps -e .`); no container, SLURM, network, wandb or spython. `make gpu-check` runs
    it.
    """
    report_dir = folder(out, "--out")
    config = one_config(configs) or Path(GPU_CHECK_CONFIG)
    from pyrecover.bench import gpu_check as check

    if not math.isfinite(step_timeout) or step_timeout < 0:
        raise user_error(f"--step-timeout {step_timeout:g}: give seconds, or 0 for no limit")
    if not math.isfinite(budget) or budget < 0:
        raise user_error(f"--budget {budget:g}: give seconds, or 0 for no budget")
    try:
        report = check.gpu_check(report_dir, config, overrides or [], steps, warmup, interval,
                                 size_gb, tests, allow_cpu, note=_note, only=tuple(only or ()),
                                 cpu_repeat=cpu_repeat,
                                 cpu_state_gb=cpu_state_gb, cpu_steps=cpu_steps,
                                 step_timeout=step_timeout if step_timeout > 0 else None,
                                 budget_s=budget if budget > 0 else None, rounds=rounds)
    except check.GpuCheckError as exc:
        raise user_error(exc) from None
    typer.echo(check.format_report(report), nl=False)
    failed = [n for n, s in report["steps"].items() if s["returncode"] != 0]
    if failed:
        typer.echo(f"error: {', '.join(failed)} failed; see the logs in {out}", err=True)
        raise typer.Exit(1)
