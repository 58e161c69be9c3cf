"""The `pyrecover` command: parse, call, print. The work happens in the modules it calls.

A user mistake (bad config, missing data, bad run directory) ends in one line on stderr
starting with `error:` and exit code 2; a bug still shows its traceback.
"""

from __future__ import annotations

import os
import sys
import warnings

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
from pyrecover.oneline import quiet

app = typer.Typer(
    help="Train PyTorch models on SLURM clusters through time limits, preemption and crashes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)


def versions() -> str:
    """versions names pyrecover, torch and Python, as a bug report needs them; torch's from its
    installed metadata (importing torch would cost seconds)."""
    from importlib import metadata

    import pyrecover

    try:
        torch = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch = "not installed"
    python = ".".join(map(str, sys.version_info[:3]))
    return f"pyrecover {pyrecover.__version__} (torch {torch}, Python {python})"


def _version(value: bool) -> None:
    if value:
        typer.echo(versions())
        raise typer.Exit()


@app.callback()
def _options(version: bool = typer.Option(
        False, "--version", is_eager=True, callback=_version,
        help="Print the versions of pyrecover, torch and Python, and exit.")) -> None:
    """Train PyTorch models on SLURM clusters through time limits, preemption and crashes."""


# Each command's line in `pyrecover --help`, whole (typer cut the docstrings' first lines).
app.command(short_help="Train (alone, under srun or torchrun), resuming from a checkpoint.")(train)
app.add_typer(data_app, name="data", short_help="Build a parquet corpus from files of text.")
app.add_typer(ckpt_app, name="ckpt", short_help="List, verify, export and convert checkpoints.")
app.add_typer(image_app, name="image", short_help="Check and build the Apptainer image.")
app.add_typer(bench_app, name="bench",
              short_help="Measure checkpoints, training, restarts and storage.")
app.add_typer(sweep_app, name="sweep",
              short_help="Grid, random and bayes searches as one SLURM job array.")
app.command(short_help="Train, kill -9 and resume on this machine: the whole promise.")(demo)
app.command(short_help="Render the job script from YAML and submit it to SLURM.")(launch)
app.command(short_help="Plot loss and throughput with checkpoints and restarts.")(plot)
app.command(short_help="Show a run's state, restarts, checkpoints and goodput.")(status)
app.command(short_help="End a run's SLURM job for good, saving a checkpoint.")(cancel)


# What a command may raise that is no bug here, by the module and name of its class. They
# are looked up only among the modules already imported: an exception of a class whose
# module was never imported cannot have been raised, and importing those modules (torch with
# the data, the loop, the trainer) only to name one cost every mistake seconds, 4-6 s on the
# 2-core VM and far more on a cluster's login node, before its one line.
USER_ERRORS = (("pyrecover.config_schema", "ConfigError"), ("pyrecover.datasource", "DataError"),
               ("pyrecover.hostlist", "DistError"),
               ("pyrecover.checkpoint.store", "CheckpointError"),
               ("pyrecover.loop", "TrainingError"), ("pyrecover.status", "StatusError"),
               ("pyrecover.slurm", "LaunchError"), ("pyrecover.sweep", "SweepError"),
               ("pyrecover.runlock", "RunLocked"))
# Faults, not bugs: exit 1 with one line, no traceback.
FAULTS = (("pyrecover.peers", "PeerLost"), ("pyrecover.checkpoint.manager", "SaveFailed"),
          ("pyrecover.checkpoint.resume", "ResumeFailed"), ("pyrecover.rundir", "StorageError"),
          ("pyrecover.sweep.agent", "AgentUnavailable"), ("pyrecover.runlock", "HeldByThisJob"),
          ("pyrecover.slurm", "SlurmUnavailable"), ("pyrecover.sweep", "WandbUnavailable"),
          ("pyrecover.dist", "GroupUnreachable"))


def loaded(names: tuple[tuple[str, str], ...]) -> tuple[type[BaseException], ...]:
    """loaded is the classes `names` (module, class) whose modules this process imported (one
    still being imported may not have its class yet)."""
    found = (getattr(sys.modules.get(module), name, None) for module, name in names)
    return tuple(cls for cls in found if cls is not None)


def main() -> None:
    # torch warns of every pickle protocol but its own at each load of a file it then
    # refuses or reads: two lines of its source above the one line a user gets (the refusal
    # is said there, oneline.first_line).
    warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
    try:
        if sys.argv[1:2] == ["train"]:  # what restarts; not `launch`, whose job would inherit
            from pyrecover import preempt

            preempt.catch_early()  # (done already where `python -m pyrecover` started it)
            startup.quiet_torch_warnings()  # (c10 reads it when torch loads)
            startup.use_bytecode_cache()  # before torch is imported (startup.py); it looks
        _main()  # for torch on sys.path: a Ctrl-C may come in the middle of it
    except KeyboardInterrupt:  # outside the command (typer's own exits 130): while it starts
        sys.exit(130)
    except SystemExit as done:
        from pyrecover import dist

        if dist.set_up_a_trainer():  # a trainer: its group is left, its checkpoint saved
            dist.exit_now(done.code)
        raise


def _main() -> None:
    try:
        code = app(standalone_mode=False)  # the parser's mistakes come here: one line each
    except typer.Abort:
        typer.echo("Aborted!", err=True)
        sys.exit(1)
    except Exception as exc:
        if _parser_error(exc):  # `--nproc 0`, `--bogus`, a missing argument
            if type(exc).__name__ == "NoArgsIsHelpError":  # `pyrecover data`: its help
                exc.show()
            else:
                ctx = getattr(exc, "ctx", None)
                hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
                typer.echo(f"error: {exc.format_message().rstrip('.')}{hint}", err=True)
            sys.exit(exc.exit_code)
        if isinstance(exc, loaded(USER_ERRORS)):
            if not quiet(exc):  # (every rank raised it: rank 0 says it, said_once)
                typer.echo(f"error: {exc}", err=True)
            sys.exit(EXIT_USER_ERROR)
        from pyrecover.preempt import EXIT_STOPPED, StopRequested

        if isinstance(exc, StopRequested):  # saved; the job script requeues on this code
            sys.exit(EXIT_STOPPED)  # (rank 0 logged it once; every rank would say it again)
        if isinstance(exc, loaded(FAULTS)):
            if not quiet(exc):
                typer.echo(f"error: {exc}", err=True)
            sys.exit(1)
        if isinstance(exc, OSError):  # the file system's answer, not a bug: one line
            typer.echo(f"error: {os_error_line(exc)}", err=True)
            sys.exit(EXIT_USER_ERROR if isinstance(exc, PermissionError) else 1)
        raise
    # typer.Exit(code) comes back as its code. Every end is a SystemExit, as in click's own
    # standalone mode: main() ends a trainer's process through dist.exit_now on it.
    sys.exit(code if isinstance(code, int) else 0)


def os_error_line(exc: OSError) -> str:
    """os_error_line says what an OSError no command caught means: which path, and what to
    do about a permission (exit 2: no retry helps; any other, such as EIO, exits 1)."""
    where = "" if exc.filename is None else (
        os.fsdecode(exc.filename) + (f" -> {os.fsdecode(exc.filename2)}" if exc.filename2
                                     else ""))
    what = exc.strerror or type(exc).__name__
    if isinstance(exc, PermissionError):
        return (f"permission denied: {where or 'a file'}; give this user access to it (or run "
                "as its owner)")
    return f"{where}: {what}" if where else f"{what} ({exc})"


def _parser_error(exc: Exception) -> bool:
    """_parser_error tells click's ClickException (typer's own copy of click from 0.22 on, a
    TyperException) from everything else a command raises."""
    return type(exc).__module__.split(".")[0] in ("click", "typer") and all(
        hasattr(exc, name) for name in ("format_message", "exit_code", "show"))
