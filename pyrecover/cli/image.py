"""`pyrecover image ...`: check and build the Apptainer image (containers/pyrecover.def)."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli.errors import user_error

image_app = typer.Typer(help="Check and build the Apptainer image.", no_args_is_help=True)

EXIT_PROBLEMS = 1

DefArg = Annotated[Path, typer.Argument(
    help="Apptainer definition file.", exists=True, dir_okay=False, readable=True)]
SifArg = Annotated[Path, typer.Argument(help="The image file to write.")]


@image_app.command("check", short_help="Check a definition file without building it.")
def check(definition: DefArg = Path("containers/pyrecover.def")) -> None:
    """Check a definition file without building it: one `DEF:LINE: message` per problem.

    spython must read it as written, and it must build pyrecover's image: a docker base,
    the project copied in and pip-installed without replacing torch, a runscript, a test.
    %files sources are looked up from the current directory, as `apptainer build` does.
    Exit code 1 if anything is wrong.
    """
    problems = _problems(definition)
    for problem in problems:
        typer.echo(problem.format(definition))
    if problems:
        raise typer.Exit(EXIT_PROBLEMS)
    typer.echo(f"{definition}: OK")


@image_app.command("build", short_help="Build the SIF image with apptainer.")
def build(
    definition: DefArg = Path("containers/pyrecover.def"),
    sif: SifArg = Path("pyrecover.sif"),
    force: Annotated[bool, typer.Option(help="Overwrite SIF without asking.")] = False,
) -> None:
    """Build the SIF image with `apptainer build` (with --fakeroot when not root).

    Run it from the project root: apptainer reads the definition's relative %files sources
    from the current directory. The definition is checked first; the exact command is
    printed before it runs, and its exit code is this command's.
    """
    from pyrecover import container

    apptainer = container.find_apptainer()
    if apptainer is None:
        raise user_error(container.APPTAINER_MISSING)
    problems = _problems(definition)
    for problem in problems:
        typer.echo(problem.format(definition), err=True)
    if problems:
        raise typer.Exit(EXIT_PROBLEMS)
    argv = container.build_argv(definition, sif, fakeroot=os.geteuid() != 0, force=force,
                                apptainer=apptainer)
    typer.echo(f"+ {shlex.join(argv)}")
    raise typer.Exit(subprocess.call(argv))


def _problems(definition: Path) -> list:
    """The definition's problems, with %files sources looked up from the current directory."""
    from pyrecover import container

    try:
        return container.check_definition(definition, root=Path.cwd())
    except container.ContainerError as exc:
        raise user_error(exc) from None
