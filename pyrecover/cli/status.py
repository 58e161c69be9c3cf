"""`pyrecover status RUN_DIR`: what happened to a run, for a person or (--json) a script."""

from __future__ import annotations

import contextlib
import shlex
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from pyrecover.cli.errors import EXIT_USER_ERROR, PathText, run_folder, user_error

if TYPE_CHECKING:
    from pyrecover.rundir import RunDir


def status(
    run_dir: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        help="A run directory (<storage>/<exp_name>), or a storage folder: lists its runs.")],
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object, for scripts (a "
                                          "storage folder: a list, one per run).")] = False,
    clear_bad_nodes: Annotated[bool, typer.Option(
        "--clear-bad-nodes", help="Forget the nodes this run excludes (after a failed health "
        "check, hang or crash), so its next job may use them again; then show the status.")] =
    False,
) -> None:
    """Show what happened to a run: state, restarts by cause, last checkpoint, goodput,
    excluded nodes.

    State: finished, stopped (will resume; a run started by hand: resumes when started again),
    crashed, hung (the watchdog ended a stuck rank, exit 76), health check failed (exit 77,
    before training; a job excludes the node and requeues), error, cancelled, ended (the job
    gave up: why), failed before the trainer started (the job's newest start ended before
    its trainer recorded anything, say the container did not start; requeued, or restarted in
    the job), not started (no process started yet), starting up (its first start has begun,
    its `start` not yet recorded: who holds the run's lock), running (who holds the run's lock),
    killed (no end recorded, and the lock is free and was last held by a process on this host
    that is gone, or the job script requeued or restarted it), or "running or killed" (the
    lock's last holder was on another host, whose lock may be invisible here, or the storage has
    no locks to ask); and "launched again (before: ...)" where a run that had ended (finished,
    cancelled, crashed...) has a new job queued or starting, to train on. Starts: one per
    process start, and one per start of the job that ended
    before its trainer recorded anything; each one after the first is a restart, by why the one
    before ended (stop and its signal, time limit, cancelled by `pyrecover cancel`, crash,
    hang, health check failed, error, ended during start-up, failed before the trainer started,
    killed with no record). Saves: the seconds the loop waited for checkpoints, stop
    checkpoints too (the ledger's checkpoint stall), and apart from them the seconds the saves
    took to write, each one's start to its commit (in the background where async). Lost:
    steps computed after the last checkpoint and computed again. Goodput: the share of the
    wall time (first record to last, across every requeue) spent in productive training; the
    ledger below it splits that wall time by cause (queue wait, start up, restore, checkpoint
    stall, lost work, productive, idle, remainder), adding up to it. Last interruption: each
    phase of the newest stop and start, with the seconds between them.

    A storage folder (run.storage) that holds runs: one line per run or sweep directly inside
    it, the most recently active first: its step of max_steps, last checkpoint and its age,
    SLURM job and its state in the queue (one squeue for all), goodput and state (in the words
    above). A sweep is listed with its number of trials (`pyrecover sweep status DIR` shows
    them); a folder that cannot be read says why in its row. Folders
    nested deeper than one level are not searched.

    \b
    Examples:
      pyrecover status runs/tiny
      pyrecover status runs/tiny --json
      pyrecover status runs                 # every run in the storage folder runs/
    """
    _status(run_folder(run_dir, "status"), as_json, clear_bad_nodes)


def _status(run_dir: Path, as_json: bool, clear_bad_nodes: bool) -> None:
    """_status is `status` of the run directory `run_dir`."""
    import json

    from pyrecover import status as status_mod
    from pyrecover import status_text
    from pyrecover.badnodes import clear_bad_nodes as clear
    from pyrecover.rundir import RunDir
    from pyrecover.slurm.query import (
        job_times,
        pending_reason,
        queued_jobs,
        slow_note,
        squeue_state,
    )
    from pyrecover.sweep.record import trial_task

    if clear_bad_nodes:
        inside = _runs_inside(run_dir)
        if inside:
            raise user_error(f"--clear-bad-nodes forgets one run's excluded nodes; {run_dir} "
                             "is a storage folder: name a run in it, e.g. pyrecover status "
                             f"{shlex.quote(str(inside[0]))} --clear-bad-nodes")
        status_mod.read(run_dir)  # refuses what is not a run directory, before changing it
        cleared = clear(RunDir(run_dir))
        typer.echo(f"cleared {len(cleared)} excluded node(s)" +
                   (f": {', '.join(cleared)}" if cleared else ""), err=True)
    elif _listed(run_dir, as_json):  # a storage folder with runs in it
        return

    def slow(ask, command):  # said only where SLURM itself is slow, not the run's files
        def call(*args):
            with slow_note(command):  # the SLURM command the user can run, not our function
                return ask(*args)
        return call
    report = status_mod.read(run_dir, squeue=slow(squeue_state, "squeue"),
                             sacct=slow(job_times, "sacct"), queued=slow(queued_jobs, "squeue"),
                             reason=slow(pending_reason, "squeue"), task=trial_task(run_dir))
    typer.echo(json.dumps(report.to_dict(), indent=1) if as_json else status_text.render(report))


def _storage_folder(folder: Path) -> bool:
    """_storage_folder tells whether `folder` may hold runs: a folder, no run or sweep itself."""
    from pyrecover.rundir import RunDir

    run = RunDir(folder)
    return folder.is_dir() and not run.is_run() and not run.is_sweep()


def _runs_inside(folder: Path) -> list[Path]:
    """_runs_inside are the run directories directly inside `folder` where it is a storage
    folder; one it cannot enter is left out, the rest are named."""
    from pyrecover.rundir import RunDir

    def is_run(path: Path) -> bool:
        with contextlib.suppress(OSError):
            return path.is_dir() and RunDir(path).is_run()
        return False

    if not _storage_folder(folder):
        return []
    with contextlib.suppress(OSError):
        return sorted(p for p in folder.iterdir() if is_run(p))
    return []


def _launched(run_dir: Path) -> bool:
    """_launched tells whether `run_dir` has a job script (False where it cannot be read)."""
    from pyrecover.rundir import RunDir

    try:
        return RunDir(run_dir).job_script.is_file()
    except OSError:
        return False


def _listed(folder: Path, as_json: bool) -> bool:
    """_listed shows the runs and sweeps inside `folder` where it is a storage folder (no run
    or sweep itself); False where it is not one, or holds none (the one-line error follows:
    status_mod.read's)."""
    import json

    from pyrecover import status_list, status_text
    from pyrecover.slurm.query import my_jobs, slow_note

    if not _storage_folder(folder):
        return False
    found = status_list.rows(folder)
    if not found:
        return False
    if any(row.job_id or _launched(Path(row.path)) for row in found):
        # SLURM asked once for all, only where a run was launched (its job may not have started)
        with slow_note("squeue"):
            jobs = my_jobs()
        if jobs is not None:
            found = status_list.rows(folder, jobs=jobs)
    typer.echo(json.dumps([row.to_dict() for row in found], indent=1) if as_json
               else status_text.render_rows(found))
    return True


def cancel(
    run_dir: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        help="The run directory (<storage>/<exp_name>), a sweep's trial, or a sweep's "
        "folder.")],
) -> None:
    """End a run's SLURM job for good: it saves a checkpoint and is not requeued.

    A plain `scancel` is taken for a preemption (the same SIGTERM): the job saves and
    requeues itself. This makes the job non-requeueable first (`scontrol update
    Requeue=0`), then cancels it; the trainer still stops cleanly at the next step and
    writes its checkpoint, so `pyrecover launch` of the same run later resumes from there.
    A job launched for the run that has not started yet is cancelled too. A sweep's trial
    is its own array task; a sweep's folder ends its whole job array (a relaunch of the
    sweep resumes every trial).

    \b
    Examples:
      pyrecover cancel runs/gpt-125m
      pyrecover cancel runs/tiny-lr           # every trial of the sweep
      pyrecover cancel runs/tiny-lr/trial-3   # one trial
    """
    _cancel(run_folder(run_dir, "cancel"))


def _cancel(run_dir: Path) -> None:
    """_cancel is `cancel` of the run (or sweep) folder `run_dir`."""
    from pyrecover import status as status_mod
    from pyrecover.rundir import RunDir
    from pyrecover.slurm import SlurmUnavailable
    from pyrecover.slurm.query import LIVE_STATES, queued_jobs, squeue_state
    from pyrecover.sweep.record import trial_task

    if RunDir(run_dir).is_sweep() and not RunDir(run_dir).config.is_file():
        _cancel_sweep(run_dir)
        return
    job = status_mod.slurm_job(run_dir)  # the newest job that started the run, if any
    state = squeue_state(job) if job is not None else None
    jobs = [(job, state)] if job is not None and state in LIVE_STATES else []
    # and jobs submitted for it that have not started yet (launch's job.sbatch; a trial's
    # task in its sweep's newest array)
    queued = queued_jobs(RunDir(run_dir).job_script)
    jobs += [q for q in queued or [] if q[0] != job]
    task = trial_task(run_dir)
    task_state = squeue_state(task) if task is not None and task != job else None
    if task_state in LIVE_STATES:
        jobs.append((task, task_state))
    launched = job is not None or RunDir(run_dir).job_script.is_file()
    if not jobs and queued is None and launched:  # (squeue_state's None: the same silence)
        raise SlurmUnavailable(f"squeue did not answer, so whether {run_dir} has a job "
                               "queued or running is unknown: try again once SLURM "
                               "answers (`squeue --me`)")
    if not jobs and job is None:
        raise status_mod.StatusError(f"{run_dir} has no SLURM job to cancel (none started it "
                                     "and none is queued for it); stop a local run with Ctrl-C")
    if not jobs:
        raise status_mod.StatusError(f"job {job} of {run_dir} is not queued or running ("
                                     f"{state or 'SLURM does not list it'}); nothing to cancel")

    def taken(queued: str, said_state: str, requeue_off: bool) -> tuple[bool, str]:
        # recorded once taken: status reads it as the run's end (a job cancelled in start-up)
        RunDir(run_dir).event("cancel", job_id=queued, slurm_state=said_state,
                              requeue_off=requeue_off)
        return said_state != "PENDING", f"cancelled job {queued} ({said_state}): " + (
            "it was waiting in the queue and will not start" if said_state == "PENDING" else
            "it saves a checkpoint at its next step and is not requeued; `pyrecover status` "
            "shows when it has ended")

    ending = _cancelled_before(RunDir(run_dir), jobs)
    for queued in ending:
        typer.echo(f"job {queued} is already ending: `pyrecover cancel` cancelled it for good "
                   "before (it saves a checkpoint and is not requeued); `pyrecover status` "
                   "shows when it has ended", err=True)
    # every one not already ending, whichever scancel refuses
    _exit_with([_cancel_one(queued, "job", partial(taken, queued, said_state))
                for queued, said_state in jobs if queued not in ending])


def _cancelled_before(run: RunDir, jobs: list[tuple[str, str]]) -> set[str]:
    """_cancelled_before is those of `jobs` that are COMPLETING after a `pyrecover cancel`
    that made them non-requeueable: the stop's save runs while SLURM lists the job as
    COMPLETING, and a second cancel then read scontrol's "Job has already finished" as a job
    that may requeue itself (an error, exit 1) though the first had turned requeueing off."""
    from pyrecover.rundir import read_jsonl

    done = {str(e.get("job_id")) for e in read_jsonl(run.events)
            if e.get("event") == "cancel" and e.get("requeue_off") is True}
    return {job for job, state in jobs if state == "COMPLETING" and job in done}


def _cancel_one(job: str, what: str, taken: Callable[[bool], tuple[bool, str]]) -> int:
    """_cancel_one ends `job` (a `what`: job, job array) for good and says how that went.
    `taken(requeue_off)` runs once scancel took it (`requeue_off`: scontrol made it
    non-requeueable): it records the cancel and returns whether a task of
    the job runs (whose job script would requeue it) and the line that says it is cancelled.
    Returns the exit code it asks for: 2 where scancel refused the job, 1 where a running one
    stays requeueable (a fault of SLURM's, not the user's mistake), else 0."""
    from pyrecover.slurm.query import cancel_job

    done = cancel_job(job)
    if done.refused:
        typer.echo(f"error: could not cancel {what} {job}: {one_line(done.refused)}", err=True)
        return EXIT_USER_ERROR
    running, said = taken(done.requeueable is None)
    if done.requeueable and running:
        typer.echo(requeue_kept(job, done.requeueable), err=True)
        return 1
    typer.echo(said, err=True)
    if done.requeueable:  # (no task started: none runs a script to requeue it)
        typer.echo(requeue_note(job, done.requeueable), err=True)
    return 0


def _exit_with(codes: list[int]) -> None:
    """_exit_with ends the command with the worst of `codes` (_cancel_one's, one per job):
    a refused job's 2 over a requeueable one's 1, as the one line of a single job says."""
    if max(codes, default=0):
        raise typer.Exit(max(codes))


def one_line(said: str) -> str:
    return " ".join(said.split())


def requeue_note(job: str, said: str) -> str:
    return (f"note: scontrol did not make job {job} non-requeueable ({one_line(said)}); it "
            "had not started, so nothing requeues it")


def requeue_kept(job: str, said: str) -> str:
    """requeue_kept is the error line for a running job (or array) scancel took while
    `scontrol update Requeue=0` failed: its job script takes the cancel for a preemption."""
    return (f"error: job {job} was cancelled, but scontrol did not make it non-requeueable "
            f"({one_line(said)}): its job script takes the cancel for a preemption and may "
            "requeue itself; if `pyrecover status` shows it queued again, "
            f"`scancel {job}` while it waits ends it for good")


def _cancel_sweep(sweep_dir: Path) -> None:
    """_cancel_sweep ends a sweep's live job arrays for good: each array is made
    non-requeueable and cancelled as one job, then each trial whose task it took records the
    cancel (as a run's cancel does)."""
    from pyrecover import status as status_mod
    from pyrecover.rundir import RunDir
    from pyrecover.slurm import SlurmUnavailable
    from pyrecover.slurm.query import LIVE_STATES, array_states, queued_jobs

    queued = queued_jobs(RunDir(sweep_dir).root / "job.sbatch")
    if queued is None:
        raise SlurmUnavailable(f"squeue did not answer, so whether sweep {sweep_dir} "
                               "has a job array in the queue is unknown: try again once "
                               "SLURM answers (`squeue --me`)")
    arrays = list(dict.fromkeys(job.split("_")[0] for job, _ in queued))
    if not arrays:
        raise status_mod.StatusError(f"sweep {sweep_dir} has no job array queued or running; "
                                     "nothing to cancel")
    codes = []
    for array in arrays:  # every one, whichever scancel refuses
        live = {int(task.split("_")[1]): state for task, state in array_states(array).items()
                if state in LIVE_STATES and task.split("_")[1].isdigit()}
        codes.append(_cancel_one(array, "job array", partial(_array_taken, sweep_dir, array,
                                                             live)))
    _exit_with(codes)


def _array_taken(sweep_dir: Path, array: str, live: dict[int, str],
                 requeue_off: bool) -> tuple[bool, str]:
    """_array_taken records the cancel in each trial whose task of `array` was live (as a
    run's cancel does); whether one of them runs, and the line that says the array is
    cancelled (_cancel_one's `taken`)."""
    from pyrecover.rundir import RunDir
    from pyrecover.sweep.trials import trial_name

    for index, state in sorted(live.items()):  # recorded once taken, as a run's cancel
        RunDir(Path(sweep_dir) / trial_name(index)).event(
            "cancel", job_id=f"{array}_{index}", slurm_state=state, requeue_off=requeue_off)
    running = [f"{trial_name(i)} ({s})" for i, s in sorted(live.items()) if s != "PENDING"]
    waiting = [trial_name(i) for i, s in sorted(live.items()) if s == "PENDING"]
    parts = []
    if running:
        parts.append(", ".join(running) + (
            " saves a checkpoint at its next step and is not requeued" if len(running) == 1
            else " each save a checkpoint at their next step and are not requeued"))
    if waiting:
        parts.append(", ".join(waiting) + " waiting in the queue will not start")
    parts = parts or ["no task of it requeues"]  # (SLURM listed none of its tasks)
    return bool(running), (f"cancelled job array {array}: {'; '.join(parts)}; `pyrecover sweep "
                           f"status {sweep_dir}` shows when they have ended")
