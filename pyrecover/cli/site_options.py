"""The cluster-profile options `pyrecover launch` and `pyrecover sweep launch` share: one
declaration each, so the two commands cannot drift apart (they did once: sweep launch
ignored $PYRECOVER_CLUSTER). Each overrides the profile key it names in its help; a sweep
applies them to every trial. Imports no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

P = "cluster profile"
# The values written out for --help (the CLI imports neither module to start);
# tests/unit/test_cli_help.py holds them to slurm.profile.LAUNCHERS and CHECKPOINT_MODES.
LAUNCHERS = "srun|torchrun|spawn|none"
CHECKPOINT_MODES = "vanilla|dcp|memory"

Cluster = Annotated[str | None, typer.Option(  # text: an empty one is not the Path '.'
    metavar="<path>", help="Cluster profile YAML (e.g. launch/clusters/local.yaml); the "
    "options below override its keys. Default: $PYRECOVER_CLUSTER, else "
    "~/.config/pyrecover/cluster.yaml.")]
Nodes = Annotated[int | None, typer.Option(help=f"Nodes, per trial in a sweep ({P}: nodes).")]
Partition = Annotated[str | None, typer.Option(help=f"Partition ({P}: partition).")]
Account = Annotated[str | None, typer.Option(help=f"Account ({P}: account).")]
Time = Annotated[str | None, typer.Option(
    help=f"Time limit, per trial in a sweep: MM, MM:SS, HH:MM:SS, D-, D-HH, D-HH:MM, D-HH:MM:SS "
    f"or infinite ({P}: time).")]
GpusPerNode = Annotated[int | None, typer.Option(
    help=f"GPUs per node = tasks per node ({P}: gpus_per_node).")]
CpusPerTask = Annotated[int | None, typer.Option(
    help=f"CPU cores per task ({P}: cpus_per_task).")]
Image = Annotated[str | None, typer.Option(
    metavar="<path>",
    help=f"Apptainer image, .sif ({P}: image; else $PYRECOVER_IMAGE, else ./pyrecover.sif).")]
Binds = Annotated[list[str] | None, typer.Option(
    metavar="SRC[:DST[:ro]]", help=f"Bind mount, added to the profile's binds, e.g. --bind "
    f"/datasets:/data:ro; run.storage is always bound. Repeatable ({P}: binds).")]
Launcher = Annotated[str | None, typer.Option(
    metavar=LAUNCHERS,
    help="srun: one task per GPU in the container; torchrun: one torchrun per node; spawn: "
    "one task per node running `pyrecover train --nproc GPUS` (both in the container when "
    f"there is an image); none: one task per GPU with this python, no container ({P}: "
    "launcher).")]
MaxRestarts = Annotated[int | None, typer.Option(
    help="Requeues allowed (per trial in a sweep) after failures: crash, hang, failed health "
    f"check, a stop without progress; clean stops always requeue ({P}: max_restarts).")]
SignalSeconds = Annotated[int | None, typer.Option(
    help="Send the stop signal (run.stop_signal, USR2) this many seconds before the time "
    f"limit ({P}: signal_seconds).")]
Qos = Annotated[str | None, typer.Option(help=f"Quality of service ({P}: qos).")]
Constraint = Annotated[str | None, typer.Option(
    help=f"Node features the job needs, e.g. 'a100&ib' or '[rack1|rack2]' ({P}: constraint).")]
Mem = Annotated[str | None, typer.Option(
    help="Memory per node, e.g. 64G (K, M, G, T; MB without a suffix); 0: all of each node's "
    f"memory ({P}: mem).")]
Exclusive = Annotated[bool | None, typer.Option(
    "--exclusive/--no-exclusive", help=f"Whole nodes, shared with no other job ({P}: "
    "exclusive).", show_default=False)]
SbatchExtra = Annotated[list[str] | None, typer.Option(
    metavar="--NAME[=VALUE]", help="An sbatch option pyrecover has no key for, written as an "
    "#SBATCH line, e.g. --sbatch-extra=--reservation=big; added to the profile's. Repeatable "
    f"({P}: sbatch_extra).")]


def resolve(cluster: str | None, bind: list[str] | None, sbatch_extra: list[str] | None,
            check: bool = True, **overrides: Any):
    """resolve is the profile a submission uses (pyrecover.slurm.profile.resolve): the
    options given (None: not given) over the profile found from `cluster` or the
    environment; checked unless not `check`."""
    import os

    from pyrecover.slurm import profile

    return profile.resolve(cluster, os.environ, Path.home(), os.getcwd(),
                           binds=tuple(bind or ()), sbatch_extra=tuple(sbatch_extra or ()),
                           check=check, **overrides)


def dry_run_image(prof, cwd: str) -> tuple[Any, list[str]]:
    """dry_run_image is the profile a --dry-run renders, and what to say of its image: a
    launch refuses an image that is not there, but the script is worth seeing before `make
    image` has run. Launcher srun with no image set renders ./pyrecover.sif (absolute), the
    file `make image` builds where launch runs; a named image missing here is rendered as
    named (it may be on the cluster's filesystem only)."""
    import dataclasses
    import os

    from pyrecover.slurm import profile

    if prof.launcher == "srun" and prof.image is None:
        image = os.path.join(os.path.abspath(cwd), profile.LOCAL_IMAGE)
        return dataclasses.replace(prof, image=image), [
            f"no image is set: the script names {image}, which `make image` builds here; a "
            "launch refuses it until it exists (or set image in the profile, --image or "
            f"{profile.IMAGE_ENV})"]
    if prof.image is not None and not Path(prof.image).is_file():
        return prof, [f"image {prof.image!r} does not exist here: a launch from this machine "
                      "would refuse it (build it with `make image`, or fix image/--image)"]
    return prof, []


def job_notes(spec, data_paths: list[str], spare: bool = True) -> list[str]:
    """job_notes are what may well be right about a job (a run's or a sweep's array) but is
    worth a look before it queues: said, not refused. `spec`: the rendered JobSpec;
    `data_paths`: the data.path of each run it trains (a sweep may sweep it); `spare`: the
    command has --spare-nodes."""
    from pyrecover.slurm import query, render, sinfo

    notes = []
    for path in dict.fromkeys(data_paths):
        if not Path(path).is_file():
            notes.append(f"data.path {path} does not exist here; the job will need it on the "
                         "compute nodes")
        if spec.image is not None and render.outside_binds(path, spec.binds):
            notes.append(f"data.path {path} is outside every bind mount; add --bind for its "
                         "folder unless the image has it")
    with query.slow_note("sinfo"):
        described = query.sinfo(sinfo.SINFO_FORMAT)
    unfit = sinfo.fit_problem(sinfo.parse_sinfo(described or ""), spec.partition,
                              spec.nodes + spec.spare_nodes, spec.gpus_per_node, spare)
    if unfit:
        notes.append(unfit)
    return notes
