"""How the command ends on a user's mistake: one `error:` line on stderr and exit code 2.

The code is the one the job script knows as "requeueing cannot help" (pyrecover.preempt).
"""

from __future__ import annotations

import math

import typer

from pyrecover.preempt import EXIT_USER_ERROR

__all__ = ["EXIT_USER_ERROR", "finite", "user_error"]


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
