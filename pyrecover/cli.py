"""The `pyrecover` command: parse, call, print. The work happens in the modules it calls.

A user mistake (bad config, missing data, bad run directory) ends in one line on stderr
starting with `error:` and exit code 2; a bug still shows its traceback.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli_bench import bench_app
from pyrecover.cli_ckpt import ckpt_app
from pyrecover.cli_data import data_app
from pyrecover.cli_image import image_app
from pyrecover.cli_launch import launch
from pyrecover.cli_plot import plot
from pyrecover.config import ConfigError

EXIT_USER_ERROR = 2

app = typer.Typer(
    help="Train PyTorch models on SLURM clusters through time limits, preemption and crashes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.add_typer(data_app, name="data")
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(image_app, name="image")
app.add_typer(bench_app, name="bench")

ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="Experiment YAML (e.g. launch/experiments/tiny.yaml). "
    "Without it the embedded CPU demo defaults are used.")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", "-s", help="Override one config key, e.g. --set train.max_steps=100. Repeatable.")]


@app.command()
def train(
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    run_dir: Annotated[Path | None, typer.Option(
        help="Run directory; default <run.storage>/<run.exp_name>.")] = None,
    nproc: Annotated[int, typer.Option(
        min=1, help="Start this many local worker processes (when not already under SLURM "
        "or torchrun): CPU with gloo, or one GPU each.")] = 1,
) -> None:
    """Train, resuming from the newest valid checkpoint in the run directory.

    Run the same command again after any interruption: it picks up where the last committed
    checkpoint left off, with the same data position and random state.
    """
    from pyrecover import config as config_mod
    from pyrecover import data, dist

    cfg = config_mod.load(config, overrides or [])
    target = run_dir if run_dir is not None else cfg.run_dir()
    env = dist.detect(os.environ)
    if nproc > 1 and env.launcher == "single":
        config_mod.check_world_size(cfg, nproc)
        data.check_source(cfg.data.path, cfg.data.column)
        argv = dist.python_argv() + ["train", "--run-dir", str(target)]
        if config is not None:
            argv += ["--config", str(config)]
        for item in overrides or []:
            argv += ["--set", item]
        code = dist.spawn_local(argv, nproc, os.environ)
        raise typer.Exit(code)
    if nproc > 1:
        typer.echo(f"note: --nproc {nproc} ignored; this process is rank {env.rank} of "
                   f"{env.world_size} under {env.launcher}", err=True)
    from pyrecover import train as train_mod

    train_mod.main(cfg, target)


@app.command()
def demo(
    workdir: Annotated[Path, typer.Option(help="Where the corpus and the run directory go.")] =
    Path("runs"),
    nproc: Annotated[int, typer.Option(min=1, help="Local worker processes.")] = 2,
) -> None:
    """Build a corpus from Python's own sources, train, kill -9 part-way, resume, finish.

    Needs no cluster and no GPU. Takes a few minutes on a 2-core laptop.
    """
    from pyrecover import demo as demo_mod

    raise typer.Exit(demo_mod.run(workdir, nproc))


app.command()(launch)
app.command()(plot)


@app.command()
def status(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (<storage>/<exp_name>).")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts.")] =
    False,
) -> None:
    """Show what happened to a run: state, restarts by cause, last checkpoint, goodput."""
    import json

    from pyrecover import status as status_mod
    from pyrecover.slurm.query import squeue_state

    report = status_mod.read(run_dir, squeue=squeue_state)
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else status_mod.render(report))


def _user_errors() -> tuple[type[BaseException], ...]:
    from pyrecover.checkpoint.store import CheckpointError
    from pyrecover.data import DataError
    from pyrecover.dist import DistError
    from pyrecover.loop import TrainingError
    from pyrecover.rundir import RunLocked
    from pyrecover.slurm import LaunchError
    from pyrecover.status import StatusError

    return (ConfigError, DataError, DistError, CheckpointError, TrainingError, StatusError,
            LaunchError, RunLocked)


def main() -> None:
    try:
        app()
    except Exception as exc:
        if isinstance(exc, _user_errors()):
            typer.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)
        from pyrecover.preempt import EXIT_STOPPED, StopRequested
        from pyrecover.train import PeerLost

        if isinstance(exc, StopRequested):  # saved; the job script requeues on this code
            typer.echo(f"pyrecover: {exc}", err=True)
            sys.exit(EXIT_STOPPED)

        from pyrecover.checkpoint.manager import SaveFailed
        from pyrecover.rundir import StorageError

        # A fault, not a bug here: no traceback.
        if isinstance(exc, (PeerLost, SaveFailed, StorageError)):
            typer.echo(f"error: {exc}", err=True)
            sys.exit(1)
        raise
