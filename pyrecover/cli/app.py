"""The `pyrecover` command: parse, call, print. The work happens in the modules it calls.

A user mistake (bad config, missing data, bad run directory) ends in one line on stderr
starting with `error:` and exit code 2; a bug still shows its traceback.
"""

from __future__ import annotations

import sys

import typer

from pyrecover import startup
from pyrecover.cli.bench import bench_app
from pyrecover.cli.ckpt import ckpt_app
from pyrecover.cli.data import data_app
from pyrecover.cli.errors import EXIT_USER_ERROR
from pyrecover.cli.image import image_app
from pyrecover.cli.launch import launch
from pyrecover.cli.plot import plot
from pyrecover.cli.status import cancel, status
from pyrecover.cli.sweep import sweep_app
from pyrecover.cli.train import demo, train
from pyrecover.config import ConfigError

app = typer.Typer(
    help="Train PyTorch models on SLURM clusters through time limits, preemption and crashes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
app.command()(train)
app.add_typer(data_app, name="data")
app.add_typer(ckpt_app, name="ckpt")
app.add_typer(image_app, name="image")
app.add_typer(bench_app, name="bench")
app.add_typer(sweep_app, name="sweep")
app.command()(demo)
app.command()(launch)
app.command()(plot)
app.command()(status)
app.command()(cancel)


def _user_errors() -> tuple[type[BaseException], ...]:
    from pyrecover.checkpoint.store import CheckpointError
    from pyrecover.data import DataError
    from pyrecover.dist import DistError
    from pyrecover.loop import TrainingError
    from pyrecover.rundir import RunLocked
    from pyrecover.slurm import LaunchError
    from pyrecover.status import StatusError
    from pyrecover.sweep import SweepError

    return (ConfigError, DataError, DistError, CheckpointError, TrainingError, StatusError,
            LaunchError, SweepError, RunLocked)


def main() -> None:
    if sys.argv[1:2] == ["train"]:  # what restarts; not `launch`, whose job would inherit it
        from pyrecover import preempt

        preempt.catch_early()  # (done already where `python -m pyrecover` started it)
        startup.use_bytecode_cache()  # before torch is imported (startup.py)
    try:
        _main()
    except SystemExit as done:
        from pyrecover import dist

        if dist.set_up_a_trainer():  # a trainer: its group is left, its checkpoint saved
            dist.exit_now(done.code)
        raise


def _main() -> None:
    try:
        app()
    except Exception as exc:
        if isinstance(exc, _user_errors()):
            typer.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)
        from pyrecover.preempt import EXIT_STOPPED, StopRequested
        from pyrecover.train import PeerLost

        if isinstance(exc, StopRequested):  # saved; the job script requeues on this code
            sys.exit(EXIT_STOPPED)  # (rank 0 logged it once; every rank would say it again)

        from pyrecover.checkpoint.manager import SaveFailed
        from pyrecover.checkpoint.resume import ResumeFailed
        from pyrecover.rundir import StorageError
        from pyrecover.sweep.agent import AgentUnavailable

        # A fault, not a bug here: no traceback.
        if isinstance(exc, (PeerLost, SaveFailed, ResumeFailed, StorageError, AgentUnavailable)):
            typer.echo(f"error: {exc}", err=True)
            sys.exit(1)
        raise
