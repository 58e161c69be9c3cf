"""How the command ends on a user's mistake: one `error:` line on stderr and exit code 2.

The code is the one the job script knows as "requeueing cannot help" (pyrecover.preempt).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import typer

from pyrecover.preempt import EXIT_USER_ERROR

__all__ = ["EXIT_USER_ERROR", "PathText", "finite", "folder", "one_config", "run_folder",
           "user_error"]


class PathText(str):
    """PathText annotates a path argument taken as the text typed (`parser=str`: the value is
    a plain str), so that an empty one can be refused (pathlib's Path('') is '.', the folder
    the command was typed in). typer labels an argument by its annotation's name: `--help`
    shows it as <path>, as it did a Path."""


PathText.__name__ = PathText.__qualname__ = "path"  # the label typer's --help shows


def user_error(problem: BaseException | str) -> typer.Exit:
    """user_error prints `error: PROBLEM` and returns the Exit to raise (code 2)."""
    typer.echo(f"error: {problem}", err=True)
    return typer.Exit(EXIT_USER_ERROR)


def finite(value: float | None) -> float | None:
    """finite is the callback of every float option: nan and inf are no size, time or count,
    and would end in a traceback where they are used."""
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"{value} is not a finite number")
    return value


def folder(value: str, flag: str) -> Path:
    """folder is the Path a folder option names. An empty one (`--dir "$SCRATCH"`, the variable
    unset) is refused: as a Path it would be the current folder, measured and written into. A
    leading ~ is the home folder (bash leaves the one in `--dir=~/bench` as it is)."""
    if not value.strip():
        raise user_error(f"{flag} is empty; give a folder, e.g. {flag} /scratch/$USER/bench")
    return Path(os.path.expanduser(value))


def run_folder(text: str, command: str, kind: str = "run", example: str = "runs/NAME"
               ) -> Path:
    """run_folder is the run (sweep, trial) directory an argument names. An empty one
    (`status "$RUN"`, RUN unset) is refused: as a Path it is the current folder, the run the
    command was typed in."""
    if not text.strip():
        raise user_error(f"the {kind} directory is empty; name the {kind}'s folder, e.g. "
                         f"pyrecover {command} {example}")
    return Path(text)


def one_config(configs: list[str] | None) -> Path | None:
    """one_config is the one --config given, if any. The option is declared repeatable only
    to see a second one: click keeps the last of a single option, and `--config a.yaml
    --config b.yaml` ran b.yaml alone, with nothing said (the files are not merged). It is
    taken as text: an empty one (`--config "$CFG"`, the variable unset) would be the Path
    '.', "a folder, not a YAML file", naming what the user never wrote."""
    if configs and len(configs) > 1:
        raise user_error(f"--config given {len(configs)} times "
                         f"({', '.join(configs)}): a run reads one experiment YAML; "
                         "merge them into one file, or override its keys with --set KEY=VALUE")
    if configs and not configs[0].strip():
        raise user_error("--config is empty; name the experiment YAML, e.g. --config "
                         "launch/experiments/tiny.yaml")
    return Path(configs[0]) if configs else None
