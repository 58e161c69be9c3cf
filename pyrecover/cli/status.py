"""`pyrecover status RUN_DIR`: what happened to a run, for a person or (--json) a script."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def status(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (<storage>/<exp_name>).")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts.")] =
    False,
) -> None:
    """Show what happened to a run: state, restarts by cause, last checkpoint, goodput."""
    import json

    from pyrecover import status as status_mod
    from pyrecover.slurm.query import job_times, squeue_state

    report = status_mod.read(run_dir, squeue=squeue_state, sacct=job_times)
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else status_mod.render(report))
