"""`pyrecover launch`: render the job script into the run directory and submit it.

Parse, call, print. Every check runs before anything is written; a user mistake is one
`error:` line and exit code 2 (ConfigError or LaunchError, caught in pyrecover.cli).
Imports no torch.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from pyrecover.config import Config
    from pyrecover.slurm.render import JobSpec

P = "cluster profile"  # help text: which options override the profile


def launch(
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="Experiment YAML (e.g. launch/experiments/gpt-125m.yaml); "
        "without it the demo defaults.")] = None,
    cluster: Annotated[Path | None, typer.Option(
        help="Cluster profile YAML (e.g. launch/clusters/local.yaml); the options below "
        "override its keys. Default: $PYRECOVER_CLUSTER, else "
        "~/.config/pyrecover/cluster.yaml.")] = None,
    init_cluster: Annotated[Path | None, typer.Option(
        metavar="PATH", help="Write a commented starting cluster profile to PATH (from sinfo "
        "where SLURM answers) and exit.")] = None,
    nodes: Annotated[int | None, typer.Option(help=f"Nodes ({P}: nodes).")] = None,
    mode: Annotated[str | None, typer.Option(
        help="Checkpoint mode, vanilla, dcp or memory: shorthand for --set "
        "checkpoint.mode=MODE.")] = None,
    exp_name: Annotated[str | None, typer.Option(
        help="Experiment name, the run directory's name: shorthand for --set "
        "run.exp_name=NAME.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one experiment key, e.g. --set train.max_steps=100. Repeatable.")] = None,
    partition: Annotated[str | None, typer.Option(help=f"Partition ({P}: partition).")] = None,
    account: Annotated[str | None, typer.Option(help=f"Account ({P}: account).")] = None,
    time: Annotated[str | None, typer.Option(
        help=f"Time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or infinite "
        f"({P}: time).")] = None,
    gpus_per_node: Annotated[int | None, typer.Option(
        help=f"GPUs per node = tasks per node ({P}: gpus_per_node).")] = None,
    cpus_per_task: Annotated[int | None, typer.Option(
        help=f"CPU cores per task ({P}: cpus_per_task).")] = None,
    image: Annotated[str | None, typer.Option(
        help=f"Apptainer image, .sif ({P}: image; else $PYRECOVER_IMAGE, else "
        "./pyrecover.sif).")] = None,
    bind: Annotated[list[str] | None, typer.Option(
        metavar="SRC[:DST[:ro]]", help=f"Bind mount, added to the profile's binds, e.g. "
        f"--bind /datasets:/data:ro; run.storage is always bound. Repeatable ({P}: binds).")]
    = None,
    max_restarts: Annotated[int | None, typer.Option(
        help=f"Requeues allowed after failures: crash, hang, failed health check, a stop "
             f"without progress; clean stops always requeue ({P}: max_restarts).")] = None,
    spare_nodes: Annotated[int | None, typer.Option(
        help="Allocate this many extra nodes: training runs on --nodes of them, and after a "
        "crash, hang or failed health check it restarts at once on the healthy ones, without "
        f"a requeue ({P}: spare_nodes).")] = None,
    max_restarts_in_job: Annotated[int | None, typer.Option(
        help=f"Restarts inside the allocation (needs spare nodes) before the job requeues "
        f"instead ({P}: max_restarts_in_job).")] = None,
    launcher: Annotated[str | None, typer.Option(
        help="srun: one task per GPU in the container; torchrun: one torchrun per node; "
        "spawn: one task per node running `pyrecover train --nproc GPUS` (both in the "
        "container when there is an image); none: one task per GPU with this python, no "
        f"container ({P}: launcher).")] = None,
    signal_seconds: Annotated[int | None, typer.Option(
        help=f"Send the stop signal (run.stop_signal, USR2) this many seconds before the "
             f"time limit ({P}: signal_seconds).")] = None,
    qos: Annotated[str | None, typer.Option(help=f"Quality of service ({P}: qos).")] = None,
    constraint: Annotated[str | None, typer.Option(
        help=f"Node features the job needs, e.g. 'a100&ib' or '[rack1|rack2]' "
             f"({P}: constraint).")] = None,
    mem: Annotated[str | None, typer.Option(
        help=f"Memory per node, e.g. 64G (K, M, G, T; MB without a suffix); 0: all of "
             f"each node's memory ({P}: mem).")] = None,
    exclusive: Annotated[bool | None, typer.Option(
        "--exclusive/--no-exclusive", help=f"Whole nodes, shared with no other job "
        f"({P}: exclusive).", show_default=False)] = None,
    sbatch_extra: Annotated[list[str] | None, typer.Option(
        metavar="--NAME[=VALUE]", help=f"An sbatch option pyrecover has no key for, written "
        f"as an #SBATCH line, e.g. --sbatch-extra=--reservation=big; added to the profile's. "
        f"Repeatable ({P}: sbatch_extra).")] = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the script and the sbatch command; write and submit "
        "nothing.")] = False,
) -> None:
    """Render job.sbatch into the run directory and submit it with sbatch.

    The run directory is <run.storage>/<run.exp_name>; run.yaml there records the resolved
    experiment with absolute paths. Launching again with a config that changes what the run
    computes is refused. Secrets such as WANDB_API_KEY are never written into the script: the
    job inherits them from this environment.

    \b
    Examples:
      pyrecover launch --init-cluster ~/.config/pyrecover/cluster.yaml
      pyrecover launch --config launch/experiments/gpt-125m.yaml --nodes 2 --mode dcp --dry-run
      pyrecover launch --config my.yaml --cluster launch/clusters/local.yaml --time 1:00:00
    """
    from pyrecover import config as config_mod
    from pyrecover.experiment import prepare_run_dir, resolve_for_run
    from pyrecover.slurm import LaunchError, profile, query, render, sinfo, submit

    if init_cluster is not None:
        typer.echo(sinfo.init_profile(init_cluster, query.sinfo(sinfo.SINFO_FORMAT)))
        return
    cwd = os.getcwd()
    sets = list(overrides or [])
    sets += [f"checkpoint.mode={mode}"] if mode is not None else []
    sets += [f"run.exp_name={exp_name}"] if exp_name is not None else []
    cfg = config_mod.load(config, sets)
    cfg = config_mod.from_dict(config_mod.to_dict(render.absolute_paths(cfg, cwd)))
    prof = profile.resolve(
        cluster, os.environ, Path.home(), cwd, binds=tuple(bind or ()), nodes=nodes,
        gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task, time=time,
        partition=partition, account=account, image=image, launcher=launcher,
        max_restarts=max_restarts, signal_seconds=signal_seconds, spare_nodes=spare_nodes,
        max_restarts_in_job=max_restarts_in_job, qos=qos, constraint=constraint, mem=mem,
        exclusive=exclusive, sbatch_extra=tuple(sbatch_extra or ()))
    cfg, batch_note = resolve_for_run(cfg, prof.nodes * prof.gpus_per_node)
    spec = render.job_spec(cfg, prof, sys.executable)
    script = render.render(spec)
    argv = submit.sbatch_argv(spec.run.job_script)
    for note in [batch_note] * bool(batch_note) + _notes(cfg, spec):
        typer.echo(f"note: {note}", err=True)

    if dry_run:
        typer.echo(script, nl=False)
        typer.echo("# --dry-run: nothing written or submitted. pyrecover would write this "
                   "script (and run.yaml) to")
        typer.echo(f"#   {spec.run.job_script}")
        typer.echo("# and run:")
        typer.echo(f"#   {shlex.join(argv)}")
        return
    if spec.image is not None and not Path(spec.image).is_file():
        raise LaunchError(f"image {spec.image!r} does not exist: build it with `make image`, "
                          "fix image/--image, or use --dry-run")
    submit.require_sbatch(os.environ)
    prepare_run_dir(cfg, spec.run, batch_note)
    spec.run.job_script.write_text(script)
    job_id = submit.submit(argv, cwd=spec.run_dir)
    log = spec.run.logs / f"{job_id}.out"
    typer.echo(f"submitted job {job_id}")
    typer.echo(f"run directory: {spec.run_dir}")
    typer.echo(f"follow the log: tail -F {shlex.quote(str(log))}")


def _notes(cfg: Config, spec: JobSpec) -> list[str]:
    """Things that may well be right but are worth a look: said, not refused."""
    from pyrecover.slurm import render

    notes = []
    if not Path(cfg.data.path).is_file():
        notes.append(f"data.path {cfg.data.path} does not exist here; the job will need it "
                     "on the compute nodes")
    if spec.image is not None and render.outside_binds(cfg.data.path, spec.binds):
        notes.append(f"data.path {cfg.data.path} is outside every bind mount; add "
                     "--bind for its folder unless the image has it")
    return notes
