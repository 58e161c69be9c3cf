"""`pyrecover sweep launch|status|values`: a grid, random or bayes search as one job array.

Parse, call, print. Every trial's config is built and checked before anything is written; a
user mistake is one `error:` line and exit code 2. Imports no torch.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli import site_options as site
from pyrecover.cli.errors import PathText, one_config, run_folder, user_error

sweep_app = typer.Typer(help="Grid, random and bayes searches: one SLURM job array, a run per "
                        "trial.", no_args_is_help=True)
FROM_WANDB = "values from wandb's bayes controller at each trial's first start"


@sweep_app.command("launch", short_help="Write the sweep and its trials and submit one job array.")
def launch(
    sweep_text: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        metavar="SWEEP.yaml", help="wandb's sweep format; parameters are config keys.")],
    configs: Annotated[list[str] | None, typer.Option(
        "--config", "-c", metavar="<path>",
        help="Experiment YAML every trial starts from.")] = None,
    cluster: site.Cluster = None,
    max_parallel: Annotated[int | None, typer.Option(
        help="Trials running at once (--array=0-N%M); default: the sweep file's "
        "max_parallel, else no limit.")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", "-s", metavar="KEY=VALUE",
        help="Override one experiment key for every trial. Repeatable.")] = None,
    mode: Annotated[str | None, typer.Option(
        metavar=site.CHECKPOINT_MODES, help="Checkpoint mode (checkpoint.mode).")] = None,
    nodes: site.Nodes = None,
    gpus_per_node: site.GpusPerNode = None,
    cpus_per_task: site.CpusPerTask = None,
    partition: site.Partition = None,
    account: site.Account = None,
    time: site.Time = None,
    image: site.Image = None,
    bind: site.Binds = None,
    launcher: site.Launcher = None,
    max_restarts: site.MaxRestarts = None,
    signal_seconds: site.SignalSeconds = None,
    qos: site.Qos = None,
    constraint: site.Constraint = None,
    mem: site.Mem = None,
    exclusive: site.Exclusive = None,
    sbatch_extra: site.SbatchExtra = None,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Print the script and the trials; write and submit nothing.")] = False,
) -> None:
    """Check every trial, write the sweep's folder and each trial's run.yaml, submit the array.

    Trial i runs in <run.storage>/<sweep name>/trial-<i>/ as an ordinary run: it stops,
    requeues (as its own array task) and resumes by itself. The trials are recorded in
    sweep.yaml; launching the same sweep again resubmits them, and each resumes. A bayes
    trial's values come from wandb's controller when it first starts (sweep values).

    \b
    Examples:
      pyrecover sweep launch launch/sweeps/tiny-lr.yaml --config launch/experiments/tiny.yaml \\
          --cluster launch/clusters/local.yaml --dry-run
    """
    from pyrecover import config as config_mod
    from pyrecover.experiment import check_run_dir, prepare_run_dir
    from pyrecover.rundir import RunDir
    from pyrecover.slurm import LaunchError, SlurmUnavailable, submit
    from pyrecover.slurm.profile import validate as check_profile
    from pyrecover.slurm.query import slow_note
    from pyrecover.slurm.render import absolute_paths
    from pyrecover.sweep import SweepError, bayes, record, render, spec, trials, wandb_sweep

    config, cwd = one_config(configs), os.getcwd()
    if not sweep_text.strip():
        raise user_error("SWEEP.yaml is empty; give the sweep's YAML file, e.g. "
                         "launch/sweeps/tiny-lr.yaml")
    sweep_file = Path(sweep_text)
    sweep = trials.absolute_values(spec.load(sweep_file), cwd)
    sets = list(overrides or []) + ([f"checkpoint.mode={mode}"] if mode else [])
    trials.check_sets(sweep, sweep_file, overrides or [], mode)
    cfg = config_mod.load(config, sets)
    cfg = trials.base_for(sweep, absolute_paths(cfg, cwd))
    prof = site.resolve(  # as `launch` resolves it, checked once the spares are dropped
        cluster, bind, sbatch_extra, check=False, nodes=nodes, gpus_per_node=gpus_per_node,
        cpus_per_task=cpus_per_task, time=time, partition=partition, account=account,
        image=image, launcher=launcher, max_restarts=max_restarts,
        signal_seconds=signal_seconds, qos=qos, constraint=constraint, mem=mem,
        exclusive=exclusive)
    dropped = max(prof.spare_nodes, 0)  # a negative count is the profile's to be refused
    prof = dataclasses.replace(prof, spare_nodes=prof.spare_nodes - dropped)
    check_profile(prof)
    if max_parallel is not None and max_parallel < 1:
        raise LaunchError(f"--max-parallel={max_parallel} is not allowed: expected >= 1")
    is_bayes = sweep.method == "bayes"
    world = prof.nodes * prof.gpus_per_node
    if is_bayes:  # wandb's controller chooses each trial's values when it starts
        wandb_sweep.require_online(cfg.tracking.wandb, os.environ)
        bayes.check_launch(sweep, cfg, world)
        count, cfgs = sweep.run_cap or 0, []
        rec = record.make(sweep, [None] * count)
        table = f"#   trial-0 .. trial-{count - 1}: {FROM_WANDB}"
    else:
        try:
            cfgs = trials.configs(sweep, cfg, trials.choose(sweep), world)
        except SweepError as exc:  # a key of the file: named with the file, as spec's are
            if not str(exc).startswith("parameters."):
                raise
            raise SweepError(f"{sweep_file}: {exc}") from None
        keys = [p.key for p in sweep.params]
        rec = record.make(sweep, [trials.resolved(c, keys) for c in cfgs])
        count = len(cfgs)
        table = "\n".join(f"#   {t['dir']}: {trials.describe(t['params'])}"
                          for t in rec.trials)
    prof, image_notes = site.dry_run_image(prof, os.getcwd()) if dry_run else (prof, [])
    job = render.array_spec(cfg, prof, sys.executable, count,
                            max_parallel or sweep.max_parallel, is_bayes)
    script = render.script(job)
    argv = submit.sbatch_argv(job.run.job_script)

    def notes() -> None:  # said once nothing refuses the launch: a refusal stays one line
        if dropped:  # a trial requeues as its own array task instead
            typer.echo(f"note: the profile's spare_nodes={dropped} is not used by a sweep: "
                       "each trial asks for its own nodes only and requeues itself", err=True)
        for note in site.job_notes(job, [c.data.path for c in cfgs] or [cfg.data.path],
                                   spare=False):
            typer.echo(f"note: {note}", err=True)
        for note in trials.repeats([t["params"] for t in rec.trials if t["params"]]):
            typer.echo(f"note: {note}", err=True)

    if dry_run:  # what the launch itself would refuse
        record.check(Path(job.run_dir), rec)
        if is_bayes:  # (a relaunch: its experiment, and each trial that started)
            bayes.check_relaunch(Path(job.run_dir), cfg, world)
        for trial_cfg in cfgs:
            check_run_dir(trial_cfg, RunDir(trial_cfg.run_dir()), trials.RENAME)
        notes()
        for note in image_notes:
            typer.echo(f"note: {note}", err=True)
        typer.echo(script, nl=False)
        how = {"grid": "grid", "bayes": "bayes, through wandb"}.get(sweep.method,
                                                                      f"random, seed {sweep.seed}")
        typer.echo(f"# --dry-run: nothing written or submitted. {count} trials ({how}):")
        typer.echo(table)
        files = "sweep.yaml, base.yaml, job.sbatch and trial-*/" if is_bayes else \
            "sweep.yaml, job.sbatch and trial-*/run.yaml"
        typer.echo(f"# pyrecover would register the sweep with wandb, write {files} to"
                   if is_bayes else f"# pyrecover would write {files} to")
        typer.echo(f"#   {job.run_dir}\n# and run:\n#   {shlex.join(argv)}")
        return
    if job.image is not None and not Path(job.image).is_file():
        raise LaunchError(f"image {job.image!r} does not exist: build it with `make image`, "
                          "fix image/--image, or use --dry-run")
    submit.require_sbatch(os.environ)
    timeout = submit.sbatch_timeout(os.environ)  # a bad value refused before anything is written
    sweep_dir = Path(job.run_dir)
    made = submit.made_for(sweep_dir.absolute())  # before anything is written
    _refuse_a_second_live_array(sweep_dir)
    record.check(sweep_dir, rec)  # before wandb is asked: a refused launch registers nothing
    if is_bayes:  # what keep_base and refresh would refuse, before sweep.yaml is written
        bayes.check_relaunch(sweep_dir, cfg, world)
    for trial_cfg in cfgs:  # (what prepare_run_dir would refuse, too)
        check_run_dir(trial_cfg, RunDir(trial_cfg.run_dir()), trials.RENAME)
    rec, cfgs = wandb_sweep.attach(sweep_file, sweep_dir, rec, cfgs or [cfg], os.environ)
    notes()
    note = record.write(sweep_dir, rec)
    if note:
        typer.echo(note, err=True)
    if is_bayes:  # each trial's run.yaml is written when wandb hands it its values
        bayes.keep_base(sweep_dir, cfgs[0])
        bayes.refresh(sweep_dir, cfgs[0], world)  # the trials that started: new limits
        for t in rec.trials:
            RunDir(sweep_dir / t["dir"]).create()  # its logs/ holds the task's output
    else:
        for trial_cfg in cfgs:
            prepare_run_dir(trial_cfg, RunDir(trial_cfg.run_dir()), rename=trials.RENAME)
    job.run.job_script.write_text(script)
    try:
        with slow_note("sbatch"):  # as launch's: a SLURM that does not answer is said
            job_id = submit.submit(argv, cwd=job.run_dir, timeout=timeout)
    except (LaunchError, SlurmUnavailable) as exc:
        # Refused, so no trial runs from it: a new sweep's folder would keep its name taken.
        if made is not None and not isinstance(exc, submit.MaybeSubmitted):
            shutil.rmtree(made, ignore_errors=True)
        raise
    record.add_job(sweep_dir, job_id)
    listed = "\n".join(line.replace("#   ", "  ", 1) for line in table.splitlines())
    typer.echo(f"submitted job array {job_id} ({count} trials):\n{listed}")  # (no script)
    if rec.wandb:
        typer.echo(f"wandb sweep {rec.wandb['sweep_id']}: {rec.wandb['url'] or '(no URL)'}")
    typer.echo(f"sweep directory: {sweep_dir}")
    typer.echo(f"follow it: pyrecover sweep status {shlex.quote(str(sweep_dir))}")


@sweep_app.command("status", short_help="Show every trial, ranked by the metric.")
def status(
    sweep_dir: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        help="<run.storage>/<sweep name>.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts.")] =
    False,
) -> None:
    """Show every trial (values, state, step, restarts, the metric), best first.

    \b
    Examples:
      pyrecover sweep status runs/tiny-lr
      pyrecover sweep status runs/tiny-lr --json
    """
    where = run_folder(sweep_dir, "sweep status", "sweep")
    import json

    from pyrecover.slurm.query import array_states, slow_note
    from pyrecover.sweep import status as sweep_status

    with slow_note("squeue"):
        report = sweep_status.read(where, slurm=array_states)
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else
               sweep_status.render(report))


@sweep_app.command("values", short_help="A bayes trial's values (run by the job array).")
def values(
    trial_text: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        metavar="trial_dir", help="<run.storage>/<sweep name>/trial-<i>.")],
    world_size: Annotated[int | None, typer.Option(
        min=1, help="The trial's world size, to check the values against.")] = None,
) -> None:
    """A bayes trial's values: asked of wandb's sweep controller at the trial's first start
    (and recorded in its folder), read back from its run.yaml at every later one.

    The job array runs this before each task's first step; exit 2: a value the config or the
    sweep refuses (nothing is recorded), exit 1: wandb could not be asked.
    """
    trial_dir = run_folder(trial_text, "sweep values", "trial", "runs/NAME/trial-0")
    import socket

    from pyrecover.config import Config
    from pyrecover.sweep import agent, bayes

    def ask(sweep_id: str, cfg: Config) -> agent.Run:
        host = f"{socket.gethostname()}-{trial_dir.resolve().name}"
        return agent.ask(sweep_id, cfg.tracking.project, cfg.tracking.entity, host)

    got = bayes.take(trial_dir, ask, world_size)
    how = f"from wandb (run {got.run_id})" if got.asked else \
        f"as recorded at its first start (run {got.run_id})" if got.run_id else \
        "as recorded at its first start (its wandb/run-id is gone: wandb logs a new run)"
    typer.echo(f"{trial_dir}: {', '.join(f'{k}={v}' for k, v in got.values.items())}, {how}",
               err=True)


def _refuse_a_second_live_array(sweep_dir: Path) -> None:
    """Each trial has one live run: a second array would rewrite the trials' run.yaml under
    the live one and have its tasks refused. The live array is one of this user's jobs that
    runs the sweep's job.sbatch (any state that still starts a trainer); a sweep launched
    before is not launched again while squeue cannot tell."""
    from pyrecover.slurm import LaunchError, SlurmUnavailable, query
    from pyrecover.sweep import record

    if not (sweep_dir / record.RECORD).is_file():
        return  # a new sweep; record.write refuses a folder that holds another one
    script = sweep_dir / "job.sbatch"
    jobs = query.queued_jobs(script)
    if jobs is None and script.exists():
        raise SlurmUnavailable(f"squeue did not answer, so whether sweep {sweep_dir.name}'s job "
                               "array is still queued is unknown: try again once SLURM answers "
                               "(`squeue --me`)")
    if jobs:
        job = jobs[0][0].split("_")[0]  # ARRAYID_TASKID, or ARRAYID_[1-5] while pending
        states = ", ".join(sorted({state for _, state in jobs}))  # its tasks' (not the first's)
        raise LaunchError(f"sweep {sweep_dir.name}'s job array {job} is still queued or "
                          f"running ({states}); wait for it (pyrecover sweep status "
                          f"{sweep_dir}) or end it for good with `pyrecover cancel "
                          f"{sweep_dir}`")
