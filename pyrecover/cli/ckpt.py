"""`pyrecover ckpt ...`: list, verify, export and convert a run's checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli.errors import PathText, run_folder, user_error

ckpt_app = typer.Typer(help="List, verify, export and convert checkpoints.", no_args_is_help=True)

RunArg = Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
    parser=str,
    help="The run directory (<storage>/<exp_name>).")]
StepOpt = Annotated[int | None, typer.Option(help="Checkpoint step; default: the newest valid.")]


@ckpt_app.command("ls", short_help="List every checkpoint: step, mode, world size, size, age.")
def ls(
    run_dir: RunArg,
    fast: Annotated[bool, typer.Option(help="Check sizes only, not checksums.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Show every checkpoint: step, mode, world size, size, age and whether it verifies.

    \b
    Examples:
      pyrecover ckpt ls runs/tiny
      pyrecover ckpt ls runs/tiny --fast --json
    """
    where = run_folder(run_dir, "ckpt ls")
    from pyrecover.checkpoint import listing

    rows = listing.list_checkpoints(listing.open_run(where), checksums=not fast)
    if as_json:
        for r in rows:
            typer.echo(json.dumps({"step": r.step, "mode": r.mode, "world_size": r.world_size,
                                   "bytes": r.size, "age_s": r.age_s, "valid": r.valid,
                                   "checked": "sizes" if fast else "checksums",
                                   "problem": r.problem}))
        return
    if not rows:
        typer.echo(f"{where}: no checkpoints yet")
        return
    typer.echo(f"{'step':>8}  {'mode':<8} {'world':>5} {'size':>10} {'age':>7}  status")
    for r in rows:
        status = ("sizes ok" if fast else "ok") if r.valid else f"INVALID: {r.problem}"
        size, age = listing.human_bytes(r.size), listing.human_age(r.age_s)
        typer.echo(f"{r.step:>8}  {r.mode:<8} {r.world_size!s:>5} {size:>10} {age:>7}  {status}")


@ckpt_app.command("verify", short_help="Check every checkpoint's sizes, checksums and model.")
def verify(run_dir: RunArg, step: Annotated[int | None, typer.Option(
        help="Check only this step; default: every checkpoint.")] = None) -> None:
    """Check sizes and checksums of every file; exit 0 only if the checkpoint(s) verify.

    Without --step, every checkpoint of the run is checked.

    \b
    Examples:
      pyrecover ckpt verify runs/tiny
      pyrecover ckpt verify runs/tiny --step 100
    """
    where = run_folder(run_dir, "ckpt verify")
    from pyrecover.checkpoint import listing, store

    run = listing.open_run(where)
    if step is not None:
        store.step_folder(run, step)  # a step the run lacks: one line, exit 2
    rows = listing.list_checkpoints(run, steps={step} if step is not None else None)
    if not rows:
        typer.echo(f"error: {where} has no checkpoints", err=True)
        raise typer.Exit(1)
    for r in rows:
        typer.echo(f"step {r.step}: " + ("ok" if r.valid else f"INVALID: {r.problem}"))
    if not all(r.valid for r in rows):
        raise typer.Exit(1)


@ckpt_app.command("export", short_help="Write the model for inference: torch, safetensors or hf.")
def export(
    run_dir: RunArg,
    out_text: Annotated[str, typer.Option(  # text: an empty one is not the Path '.'
        "--out", metavar="<path>",
        help="What to create: a file (torch, safetensors) or a new or empty folder (hf).")],
    step: StepOpt = None,
    fmt: Annotated[str | None, typer.Option(
        "--format", metavar="torch|safetensors|hf",
        help="torch: a plain state_dict file; safetensors: the same as a safetensors file; "
        "hf: a Hugging Face GPT-2 folder (config.json, model.safetensors) that "
        "transformers.GPT2LMHeadModel.from_pretrained(OUT) loads. Default: safetensors for an "
        "--out ending in .safetensors, else torch.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing --out file (never one of the run's files, never "
        "a non-empty folder).")] = False,
) -> None:
    """Write the model weights for inference, readable without pyrecover.

    `--format torch`: `torch.load(OUT, weights_only=True)`. `--format safetensors`:
    `safetensors.torch.load_model(GPT(cfg), OUT)`, the config in the file's metadata.
    `--format hf`: `GPT2LMHeadModel.from_pretrained(OUT)` gives the same logits; a model GPT-2
    cannot express is refused. safetensors and hf need `pip install 'pyrecover[hf]'`.

    \b
    Examples:
      pyrecover ckpt export runs/tiny --out model.pt
      pyrecover ckpt export runs/tiny --step 100 --format safetensors --out model.safetensors
      pyrecover ckpt export runs/tiny --format hf --out my-gpt2/
    """
    where = run_folder(run_dir, "ckpt export")
    if not out_text.strip():
        raise user_error("--out is empty; name the file to write, e.g. --out model.pt")
    out = Path(out_text)
    from pyrecover import export as export_mod
    from pyrecover.checkpoint import listing

    fmt = export_mod.format_for(out, fmt)
    done = export_mod.export_model(listing.open_run(where), step, out, fmt, replace=force)
    how = {"torch": "", "safetensors": " as safetensors",
           "hf": " as a Hugging Face GPT-2 folder"}[fmt]
    typer.echo(f"exported step {done.ckpt.step} ({done.ckpt.mode}){how} to {done.out} "
               f"({listing.human_bytes(done.size)})")
    if fmt == "hf":
        typer.echo(f"load it: transformers.GPT2LMHeadModel.from_pretrained({str(done.out)!r})")


@ckpt_app.command("convert", short_help="Convert a checkpoint to one torch file or a dcp folder.")
def convert(
    run_dir: RunArg,
    to: Annotated[str, typer.Option(
        metavar="torch|dcp", help="Target format: torch (one file) or dcp (a folder).")],
    out_text: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        metavar="out", help="File (torch) or folder (dcp) to create.")],
    step: StepOpt = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace an existing OUT file (--to torch; never one of the run's "
        "files). --to dcp writes into an empty folder, never over files.")] = False,
) -> None:
    """Convert a checkpoint of any mode (vanilla, dcp, memory) to one torch file or a dcp folder.

    `--to torch` gives one file with model, optimizer, scheduler, train state and RNG states
    (`torch.load(OUT, weights_only=True)`); `--to dcp` gives a folder that plain
    `torch.distributed.checkpoint.load` reads.

    \b
    Examples:
      pyrecover ckpt convert runs/tiny --to torch state.pt
      pyrecover ckpt convert runs/tiny --step 100 --to dcp state-dcp/
      pyrecover ckpt convert runs/tiny --to torch state.pt --force   # replace state.pt
    """
    where = run_folder(run_dir, "ckpt convert")
    if not out_text.strip():
        raise user_error("OUT is empty; name the file (--to torch) or folder (--to dcp) to "
                         "create, e.g. state.pt")
    out = Path(out_text)
    from pyrecover.checkpoint import listing, store

    run = listing.open_run(where)  # what it refuses is said before torch's import
    listing.convert_target(to, out, run, replace=force)
    if step is not None:
        store.step_folder(run, step)
    from pyrecover import offline
    from pyrecover.checkpoint import tools

    ckpt = tools.convert(run, step, to, out, offline.build_parts)
    typer.echo(f"converted step {ckpt.step} ({ckpt.mode}) to {to}: {Path(os.path.abspath(out))}")
