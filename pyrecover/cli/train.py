"""`pyrecover train` and `pyrecover demo`: train here, or show a kill and a resume."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli.errors import one_config, user_error

ConfigOpt = Annotated[list[str] | None, typer.Option(
    "--config", "-c", metavar="<path>", help="Experiment YAML (e.g. "
    "launch/experiments/tiny.yaml). Without it the embedded CPU demo defaults are used.")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", metavar="KEY=VALUE",
    help="Override one config key, e.g. --set train.max_steps=100. Repeatable.")]


def train(
    configs: ConfigOpt = None,
    overrides: SetOpt = None,
    run_dir: Annotated[str | None, typer.Option(
        metavar="<path>", help="Run directory; default <run.storage>/<run.exp_name>.")] = None,
    nproc: Annotated[int, typer.Option(
        min=1, help="Start this many worker processes here (alone, or as one srun task per "
        "node: then node n's workers are ranks n x NPROC and up): CPU with gloo, or one GPU "
        "each.")] = 1,
) -> None:
    """Train, resuming from the newest valid checkpoint in the run directory.

    Run the same command again after any interruption: it picks up where the last committed
    checkpoint left off, with the same data position and random state.

    \b
    Examples:
      pyrecover train --config launch/experiments/tiny.yaml --set train.max_steps=100 --nproc 2
      pyrecover train --config my.yaml --run-dir runs/my-try --set train.lr=3e-4
      pyrecover train --config my.yaml --set train.profile=200-202   # trace 3 steps

    Stopping: USR2 (run.stop_signal), TERM or Ctrl-C makes every rank stop after the same
    step with a checkpoint and exit 75 ("run me again"); a second Ctrl-C quits at once. Exit
    codes: 0 finished, 1 crash (or a peer died), 2 config, data or training error (a loss
    that stays NaN), 75 stopped cleanly, 76 a rank hung, 77 a health check failed.
    Checkpoints every checkpoint.interval steps, or `--set checkpoint.interval=auto` for the
    Young/Daly interval from the measured save time and the run's failures.

    Where torch has no compiled bytecode and none can be written next to it, every start
    would compile torch again: train caches it in PYRECOVER_PYCACHE (default
    $XDG_CACHE_HOME/pyrecover/pycache, else ~/.cache/pyrecover/pycache; off: no cache).
    """
    from pyrecover import batch, dist, experiment, preempt, spawn, startup
    from pyrecover import config as config_mod
    from pyrecover.rundir import RunDir

    spawn.follow_launcher(os.environ)  # a worker of `train --nproc N` ends with it
    config = one_config(configs)
    if run_dir is not None and not run_dir.strip():  # an unset shell variable: not here
        raise user_error("--run-dir is empty; give the run's folder, e.g. --run-dir runs/NAME")
    cfg = config_mod.load(config, overrides or [])
    # A leading ~ is the home folder, as in data.path and run.storage (bash leaves the one in
    # `--run-dir=~/runs/a` as it is).
    target = Path(os.path.expanduser(run_dir)) if run_dir is not None else cfg.run_dir()
    env = dist.detect(os.environ)
    run = RunDir(target)
    if run.root.exists() and not run.root.is_dir():  # before torch; said as status says it
        raise user_error(f"run directory {str(run.root)!r} is a file, not a folder; give "
                         "the run a folder of its own")
    nested = experiment.nesting_problem(run)  # (the trainer checks it again, after torch)
    if nested is not None:
        raise user_error(nested)
    if startup.CACHE_CREATED and env.rank == 0:
        typer.echo(f"pyrecover: torch's bytecode is neither installed nor writable next to "
                   f"it: this first start compiles it into {startup.BYTECODE_CACHE}, which "
                   f"every restart reads ({startup.PYCACHE_ENV}=off: no cache)", err=True)
    if nproc > 1 and env.launcher in ("single", "slurm"):  # slurm: one task per node
        workers = spawn.worker_envs(env, nproc)  # refuses a layout it cannot spawn
        batch.resolve(cfg, int(workers[0]["WORLD_SIZE"]))  # before spawning anything
        if cfg.train.device != "cpu":  # on a GPU machine counting them imports torch
            config_mod.check_local_gpus(cfg, nproc, dist.visible_gpus())
        experiment.check_data_early(cfg.data.path, cfg.data.column, run, env)
        argv = spawn.python_argv() + ["train", "--run-dir", str(target)]
        if config is not None:
            argv += ["--config", str(config)]
        for item in overrides or []:
            argv += ["--set", item]
        gc.enable()  # off for a trainer's start-up (pyrecover/__main__.py); this one waits
        code = spawn.spawn_local(argv, nproc, os.environ,
                                parent=None if env.launcher == "single" else env,
                                killed=lambda rank, how: _record_killed(run, rank, how),
                                stop=preempt.parse_signal(cfg.run.stop_signal))
        raise typer.Exit(code)
    if nproc > 1:
        typer.echo(f"note: --nproc {nproc} ignored; this process is rank {env.rank} of "
                   f"{env.world_size} under {env.launcher}", err=True)
    experiment.check_data_early(cfg.data.path, cfg.data.column, run, env)  # before torch
    from pyrecover import readahead

    # The checkpoint to resume comes off storage while torch is imported (readahead.py).
    readahead.start(run.checkpoints, env.rank, env.local_rank)
    from pyrecover import train as train_mod

    train_mod.main(cfg, target)


def _record_killed(run, rank: int, how: str) -> None:
    """_record_killed writes the crash of a worker a signal killed (the OOM killer's SIGKILL
    leaves no record of its own, and its peers only saw a connection reset) as the attempt's
    last error, where `pyrecover status` shows it. Not where no rank opened the run."""
    if run.events.is_file():
        hint = " from outside pyrecover (the kernel's OOM killer, or kill -9)" \
            if how.endswith("SIGKILL") else ""
        run.event("crash", rank=rank, error=f"rank {rank} {how}{hint}", source="launcher")


def demo(
    workdir: Annotated[str, typer.Option(
        metavar="<path>", help="Where the corpus and the run directory go.")] = "runs",
    nproc: Annotated[int, typer.Option(min=1, help="Local worker processes.")] = 2,
) -> None:
    """Build a corpus from Python's own sources, train, kill -9 part-way, resume, finish.

    Needs no cluster and no GPU. Takes about a minute on 2 cores.
    """
    from pyrecover.cli import demo as demo_mod

    if not workdir.strip():  # an unset shell variable: not the current folder
        raise user_error("--workdir is empty; give a folder, e.g. --workdir runs")
    workdir = os.path.expanduser(workdir)  # the corpus's folder, as run.storage takes it
    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise user_error(f"--workdir {workdir} is a file, not a folder; give a folder, e.g. "
                         "--workdir runs")
    try:  # before the corpus is built: a folder that cannot be had is the user's to fix
        Path(workdir).mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=workdir).close()
    except OSError as exc:
        raise user_error(f"--workdir {workdir} cannot be written ({exc.strerror or exc}); give "
                         "a folder this user can write, e.g. --workdir runs") from None
    previous = Path(workdir) / demo_mod.DEMO_RUN  # (rmtree: "Not a directory", exit 1)
    if previous.is_symlink() or (previous.exists() and not previous.is_dir()):
        what = "a symbolic link" if previous.is_symlink() else "a file"
        raise user_error(f"{previous} is {what} where the demo's run folder goes (every demo "
                         "replaces that folder): move it away, or give this demo another "
                         "--workdir")
    raise typer.Exit(demo_mod.run(Path(workdir), nproc))
