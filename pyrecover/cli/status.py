"""`pyrecover status RUN_DIR`: what happened to a run, for a person or (--json) a script."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def status(
    run_dir: Annotated[Path, typer.Argument(help="The run directory (<storage>/<exp_name>).")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts.")] =
    False,
    clear_bad_nodes: Annotated[bool, typer.Option(
        "--clear-bad-nodes", help="Forget the nodes this run excludes (after a failed health "
        "check, hang or crash), so its next job may use them again; then show the status.")] =
    False,
) -> None:
    """Show what happened to a run: state, restarts by cause, last checkpoint, goodput,
    excluded nodes."""
    import json

    from pyrecover import status as status_mod
    from pyrecover.rundir import RunDir
    from pyrecover.rundir import clear_bad_nodes as clear
    from pyrecover.slurm.query import job_times, squeue_state

    if clear_bad_nodes:
        status_mod.read(run_dir)  # refuses what is not a run directory, before changing it
        cleared = clear(RunDir(run_dir))
        typer.echo(f"cleared {len(cleared)} excluded node(s)" +
                   (f": {', '.join(cleared)}" if cleared else ""), err=True)

    report = status_mod.read(run_dir, squeue=squeue_state, sacct=job_times)
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else status_mod.render(report))
