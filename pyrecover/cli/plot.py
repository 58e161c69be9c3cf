"""`pyrecover plot RUN_DIR --out run.png`: loss, throughput and checkpoint stalls, marked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli.errors import PathText, run_folder, user_error


def plot(
    run_dir: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        help="The run directory (<storage>/<exp_name>).")],
    out_text: Annotated[str, typer.Option(  # text: an empty one is not the Path '.'
        "--out", "-o", metavar="<path>", help="The file to write: .png, .svg or .pdf (the "
        "suffix picks the format).")] = "run.png",
    width: Annotated[int, typer.Option(help="Image width in pixels.")] = 960,
    height: Annotated[int, typer.Option(help="Image height in pixels.")] = 540,
) -> None:
    """Plot loss against step, marking checkpoints, resumes, crashes and stops.

    A second panel shows tokens/s and how long each checkpoint stalled the loop. Reads
    metrics.jsonl and events.jsonl of the run directory.

    \b
    Examples:
      pyrecover plot runs/tiny --out run.png
      pyrecover plot runs/tiny --out run.svg --width 1920 --height 1080
    """
    where = run_folder(run_dir, "plot")
    if not out_text.strip():
        raise user_error("--out is empty; name the image to write, e.g. --out run.png")
    out = Path(out_text)
    from pyrecover import plot as plot_mod

    try:
        plot_mod.write(where, out, width, height)
    except plot_mod.PlotError as exc:
        raise user_error(exc) from None
    typer.echo(f"wrote {out}")
