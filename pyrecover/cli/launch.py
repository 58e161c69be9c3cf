"""`pyrecover launch`: render the job script into the run directory and submit it.

Parse, call, print. Every check runs before anything is written; a user mistake is one
`error:` line and exit code 2 (ConfigError or LaunchError, caught in pyrecover.cli).
Imports no torch.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pyrecover.cli import site_options as site
from pyrecover.cli.errors import one_config, user_error

if TYPE_CHECKING:
    from pyrecover.config import Config
    from pyrecover.rundir import RunDir
    from pyrecover.slurm.render import JobSpec

P = site.P  # help text: which options override the profile


def launch(
    ctx: typer.Context,
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>", help="Experiment YAML (e.g. "
        "launch/experiments/gpt-125m.yaml); without it the demo defaults.")] = None,
    cluster: site.Cluster = None,
    init_cluster: Annotated[str | None, typer.Option(
        metavar="<path>", help="Write a commented starting cluster profile there (from "
        "sinfo where SLURM answers) and exit.")] = None,
    nodes: site.Nodes = None,
    mode: Annotated[str | None, typer.Option(
        metavar=site.CHECKPOINT_MODES,
        help="Checkpoint mode: shorthand for --set checkpoint.mode=MODE.")] = None,
    exp_name: Annotated[str | None, typer.Option(
        help="Experiment name, the run directory's name: shorthand for --set "
        "run.exp_name=NAME.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one experiment key, e.g. --set train.max_steps=100. Repeatable.")] = None,
    partition: site.Partition = None,
    account: site.Account = None,
    time: site.Time = None,
    gpus_per_node: site.GpusPerNode = None,
    cpus_per_task: site.CpusPerTask = None,
    image: site.Image = None,
    bind: site.Binds = None,
    max_restarts: site.MaxRestarts = None,
    spare_nodes: Annotated[int | None, typer.Option(
        help="Allocate this many extra nodes: training runs on --nodes of them, and after a "
        "crash, hang or failed health check it restarts at once on the healthy ones, without "
        f"a requeue ({P}: spare_nodes).")] = None,
    max_restarts_in_job: Annotated[int | None, typer.Option(
        help=f"Restarts inside the allocation (needs spare nodes) before the job requeues "
        f"instead ({P}: max_restarts_in_job).")] = None,
    launcher: site.Launcher = None,
    signal_seconds: site.SignalSeconds = None,
    qos: site.Qos = None,
    constraint: site.Constraint = None,
    mem: site.Mem = None,
    exclusive: site.Exclusive = None,
    sbatch_extra: site.SbatchExtra = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the script and the sbatch command; write and submit "
        "nothing.")] = False,
) -> None:
    """Render job.sbatch into the run directory and submit it with sbatch.

    The run directory is <run.storage>/<run.exp_name>; run.yaml there records the resolved
    experiment with absolute paths. Launching again with a config that changes what the run
    computes is refused, and so is a run that already has a job queued or running (one job
    per run: `pyrecover cancel RUN_DIR` ends it). Secrets such as WANDB_API_KEY are never
    written into the script: the job inherits them from this environment.

    \b
    Examples:
      pyrecover launch --init-cluster ~/.config/pyrecover/cluster.yaml
      pyrecover launch --config launch/experiments/gpt-125m.yaml --nodes 2 --mode dcp --dry-run
      pyrecover launch --config my.yaml --cluster launch/clusters/local.yaml --time 1:00:00
    """
    from pyrecover import config as config_mod
    from pyrecover.experiment import check_run_dir, prepare_run_dir, resolve_for_run
    from pyrecover.slurm import LaunchError, SlurmUnavailable, query, render, sinfo, submit
    from pyrecover.slurm import profile as profile_mod

    config = one_config(configs)
    if init_cluster is not None:
        ignored = [next(o for o in p.opts if o.startswith("--")) for p in ctx.command.params
                   if p.name not in ("init_cluster", None) and getattr(
                       ctx.get_parameter_source(p.name), "name", "") == "COMMANDLINE"]
        if ignored:  # it writes what sinfo says and launches nothing
            raise user_error(f"--init-cluster writes a starting profile from sinfo and launches "
                             f"nothing, so {', '.join(ignored)} would be ignored: run it alone, "
                             "then set them in the profile or give them to the launch")
        if not init_cluster.strip():  # an unset shell variable: not "." here
            raise user_error("--init-cluster is empty; name the file to write, e.g. "
                             "--init-cluster ~/.config/pyrecover/cluster.yaml")
        found = profile_mod.find_profile(None, os.environ, Path.home(), exists=lambda _: True)
        typer.echo(sinfo.init_profile(init_cluster, query.sinfo(sinfo.SINFO_FORMAT), found))
        return
    cwd = os.getcwd()
    sets = list(overrides or [])
    sets += _shorthand("--mode", "checkpoint.mode", mode, sets)
    sets += _shorthand("--exp-name", "run.exp_name", exp_name, sets)
    cfg = config_mod.load(config, sets)
    cfg = config_mod.from_dict(config_mod.to_dict(render.absolute_paths(cfg, cwd)))
    prof = site.resolve(
        cluster, bind, sbatch_extra, nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task, time=time, partition=partition, account=account,
        image=image, launcher=launcher, max_restarts=max_restarts,
        signal_seconds=signal_seconds, spare_nodes=spare_nodes,
        max_restarts_in_job=max_restarts_in_job, qos=qos, constraint=constraint, mem=mem,
        exclusive=exclusive)
    cfg, batch_note = resolve_for_run(cfg, prof.nodes * prof.gpus_per_node)
    prof, image_notes = site.dry_run_image(prof, cwd) if dry_run else (prof, [])
    spec = render.job_spec(cfg, prof, sys.executable)
    _refuse_file_in_the_way(spec.run)
    script = render.render(spec)
    argv = submit.sbatch_argv(spec.run.job_script)
    idle = ["--max-restarts-in-job has no effect without spare nodes (a failure requeues); "
            "add --spare-nodes N"] if max_restarts_in_job and not spec.spare_nodes else []
    for note in [batch_note] * bool(batch_note) + idle + _notes(cfg, spec):
        typer.echo(f"note: {note}", err=True)

    if dry_run:
        check_run_dir(cfg, spec.run)  # what the launch itself would refuse
        for note in image_notes:
            typer.echo(f"note: {note}", err=True)
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
    timeout = submit.sbatch_timeout(os.environ)
    with query.slow_note("squeue"):
        _refuse_live(spec.run)
    made = submit.made_for(spec.run.root.absolute())
    prepare_run_dir(cfg, spec.run, batch_note)
    spec.run.job_script.write_text(script)
    try:
        with query.slow_note("sbatch"):
            job_id = submit.submit(argv, cwd=spec.run_dir, timeout=timeout)
    except (LaunchError, SlurmUnavailable) as exc:
        # Refused, so no job runs from it: no new run folder is left to look "not started".
        if made is not None and not isinstance(exc, submit.MaybeSubmitted):
            shutil.rmtree(made, ignore_errors=True)
        raise
    log = spec.run.logs / f"{job_id}.out"
    typer.echo(f"submitted job {job_id}")
    typer.echo(f"run directory: {spec.run_dir}")
    typer.echo(f"follow the log: tail -F {shlex.quote(str(log))}")


def _refuse_live(run: RunDir) -> None:
    """A run has one job at a time: a second one would rewrite run.yaml under the first (its
    next requeue starts with the new limits) and then wait on the run's lock. Its job is one
    of this user's in the queue that runs its job.sbatch, or whatever holds its lock. A run
    launched before is not launched again while squeue cannot tell (a new one has no job)."""
    from pyrecover.runlock import live_holder
    from pyrecover.slurm import LaunchError, SlurmUnavailable, query

    end = (f"let it run, or end it with `pyrecover cancel {shlex.quote(str(run.root))}` first, "
           "or launch under another --exp-name")
    jobs = query.queued_jobs(run.job_script, ending=True)  # a requeue passes COMPLETING
    if jobs is None and run.job_script.exists():  # launched before: its job may be queued
        raise SlurmUnavailable(f"squeue did not answer, so whether run {run.root} already has a "
                               "job in the queue is unknown: try again once SLURM answers "
                               "(`squeue --me`)")
    live = [job for job in jobs or [] if job[1] != "COMPLETING"]
    if live:
        raise LaunchError(f"run {run.root} already has SLURM job {live[0][0]} ({live[0][1]}): "
                          + end)
    if jobs:
        raise LaunchError(f"run {run.root} already has SLURM job {jobs[0][0]} (COMPLETING): it "
                          "is ending, or being requeued to run again; launch again once "
                          "`squeue --me` no longer lists it")
    holder = live_holder(run)
    if holder:  # started some other way (a job script of one's own, srun by hand)
        raise LaunchError(f"run {run.root} is in use by a live run ({holder}): " + end)


def _shorthand(flag: str, key: str, value: str | None, sets: list[str]) -> list[str]:
    """_shorthand is `--set KEY=VALUE` for `flag` VALUE (--mode, --exp-name). Given both ways
    with another value, it is refused: the shorthand won, even over a --set after it (where
    of two --set the later wins)."""
    if value is None:
        return []
    given = [item.partition("=")[2].strip() for item in sets
             if item.partition("=")[0].strip() == key]
    if given and given[-1] != value:  # (the last --set of the key is the one it set)
        raise user_error(f"{flag} {value} and --set {key}={given[-1]} disagree: give {key} "
                         "once")
    return [f"{key}={value}"]


def _refuse_file_in_the_way(run: RunDir) -> None:
    """A run directory that cannot be made because a file is where it, or a folder above it,
    goes is a choice of run.storage or --exp-name: refused before --dry-run shows a script
    that could never be written (the launch said `storage: cannot create`, exit 1)."""
    from pyrecover.slurm import LaunchError

    blocker = next((path for path in (run.root, *run.root.parents) if path.exists()), None)
    if blocker is not None and not blocker.is_dir():
        raise LaunchError(f"run directory {run.root} cannot be made: {blocker} is a file, not "
                          "a folder; set run.storage to a folder of runs (--set "
                          "run.storage=DIR), or choose another --exp-name")


def _notes(cfg: Config, spec: JobSpec) -> list[str]:
    """Things that may well be right but are worth a look: said, not refused."""
    from pyrecover.checkpoint.store import MANIFEST, committed_steps

    notes = []
    reached = next((step for step, folder in committed_steps(spec.run.checkpoints)
                    if (folder / MANIFEST).is_file()), None)
    if reached is not None and reached >= cfg.train.max_steps:
        notes.append(f"the run's newest checkpoint is at step {reached}, at or past "
                     f"train.max_steps={cfg.train.max_steps}: the job will end at once "
                     "(--set train.max_steps=N to train on)")
    return notes + site.job_notes(spec, [cfg.data.path])
