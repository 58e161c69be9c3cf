"""`pyrecover status RUN_DIR`: what happened to a run, read back from its files.

Everything comes from `events.jsonl`, `metrics.jsonl` and the checkpoint folders; the SLURM
state comes from `pyrecover.slurm.query` when the run has a job id and SLURM answers.
Nothing here writes.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pyrecover import ledger as ledger_mod
from pyrecover import phases
from pyrecover import status_files as files
from pyrecover.badnodes import read_bad_nodes
from pyrecover.health import Failure
from pyrecover.records import well_formed
from pyrecover.rundir import RunDir, read_jsonl
from pyrecover.runlock import live_holder
from pyrecover.slurm.query import LIVE_STATES


class StatusError(ValueError):
    """The folder is not a pyrecover run directory."""


@dataclass
class Status:
    run_dir: str
    exp_name: str
    state: str  # finished, stopped, crashed, error, running?, not started
    slurm_state: str | None
    job_id: str | None
    """The newest job, as SLURM names it (ARRAYID_TASKID for a sweep trial's array task)."""
    step: int
    max_steps: int | None
    starts: int
    restarts_by_cause: dict[str, int] = field(default_factory=dict)
    last_checkpoint: dict[str, Any] | None = None
    invalid_checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """Step folders newer than the last valid checkpoint that do not verify (sizes only)."""
    steps_lost: int = 0
    checkpoint_stall_seconds: float = 0.0
    """What saves cost the loop: the ledger's `checkpoint_stall` (stop checkpoints too)."""
    checkpoint_write_seconds: float = 0.0
    """Each committed save's start to its commit, summed (background time where async)."""
    restore_seconds: float = 0.0
    wall_seconds: float = 0.0
    goodput: float | None = None
    last_error: str | None = None
    requeue_decisions: list[dict[str, Any]] = field(default_factory=list)
    """The job script's decisions, each `job_id` as SLURM names the job (as `job_id`)."""
    hangs: list[dict[str, Any]] = field(default_factory=list)
    """`hang` events (the watchdog fired), without their stacks."""
    stragglers: list[dict[str, Any]] = field(default_factory=list)
    """The newest `straggler` event of each rank."""
    interruption: list[dict[str, Any]] = field(default_factory=list)
    """The newest interruption's phases in order (phases.py), each with its `gap` in seconds."""
    ledger: dict[str, Any] = field(default_factory=dict)
    """Wall time by cause across all requeues (ledger.py)."""
    skipped_records: int = 0
    """Records of events.jsonl and metrics.jsonl left out: not as pyrecover writes them."""
    excluded_nodes: list[dict[str, str]] = field(default_factory=list)
    """The run's bad nodes (`node`, `time`, `reason`), which its jobs leave out."""
    profile: dict[str, Any] | None = None
    """The newest `profile` event (train.profile: per-step figures and rank 0's trace)."""
    slurm_reason: str | None = None
    """Why a PENDING job waits, as squeue says (Resources, Priority, JobHeldUser, ...)."""
    failed_checkpoints: list[dict[str, Any]] = field(default_factory=list)
    """`checkpoint_failed` events since the newest committed checkpoint (training went on)."""
    persisted_snapshots: list[int] = field(default_factory=list)
    """Steps of memory mode's snapshots the survivors of a crash persisted (`.snap-step-N`),
    newest first: the next start commits the newest whole one."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read(path: str | Path, squeue=None, now: float | None = None, sacct=None,
         queued=None, reason=None, task: str | None = None) -> Status:
    """read builds the Status of a run directory; `squeue(job_id) -> state | None`,
    `sacct(job_id) -> [(submit, start, end)]` (each attempt's SLURM times),
    `queued(job_script) -> [(job_id, state)] | None` (jobs submitted for the run that have
    not started it yet) and `reason(job_id) -> str | None` (why a pending one waits) are
    optional; `task` is a sweep trial's task in its sweep's newest array (ARRAYID_INDEX),
    the job queued for the trial, which has no job script of its own."""
    run = RunDir(Path(path))
    problem = run.problem()
    if problem:
        raise StatusError(problem)
    now = time.time() if now is None else now
    garbled = [0]  # lines that are no JSON object at all
    events, skipped_events = well_formed(read_jsonl(run.events, garbled), needs_time=True)
    metrics, skipped_metrics = well_formed(read_jsonl(run.metrics, garbled), needs_time=False)
    runs = phases.job_attempts(phases.attempts(events))  # one per start, failed too
    step = max([int(m.get("step", 0)) for m in metrics] +  # (a hang's step is unfinished)
               [int(e.get("step", 0)) for e in events if "step" in e
                and e.get("event") != "hang"], default=0)
    causes = Counter(_cause(attempt) for attempt in runs[:-1])
    job_id = _newest_job(events)
    began = max((i for i, e in enumerate(events) if e.get("event") in ("start", "resume")),
                default=-1)  # an error is shown until the run starts again
    last_error = next((_error_of(e) for e in reversed(events[began + 1:])
                       if e.get("event") in ("error", "crash") or _health_failed(e)), None)
    state = _state(events)
    if runs and phases.trainerless(runs[-1]) and runs[-1][-1].get("event") in RESTARTS:
        state = f"{TRAINERLESS} ({RESTARTS[runs[-1][-1]['event']]})"  # and may again
    if state == RUNNING_OR_KILLED:  # a held lock: running; free, holder here and gone: killed
        holder = live_holder(run)
        state = state if holder is None else f"running ({holder})" if holder else KILLED
    elif state == STARTING:  # its process started: held, it starts up; free and gone, killed
        holder = live_holder(run)
        state = "starting up or killed" if holder is None else (
            f"{STARTING} ({holder})" if holder else KILLED)
    if last_error is None and (state.startswith("ended:") or state.startswith(TRAINERLESS)):
        last_error = files.logged_error(run)  # failed before it could record an event
    write_s = sum(float(e.get("seconds", 0)) for e in events if e.get("event") == "checkpoint")
    restore_s = sum(float(e.get("restore_seconds", 0)) for e in events
                    if e.get("event") == "resume")
    last_ckpt, invalid = files.last_checkpoint(run, now)
    slurm_state = squeue(job_id) if (squeue and job_id) else None
    ended = slurm_state not in LIVE_STATES  # the last job that started it, or none did
    waiting = [q for q in (queued(run.job_script) or []) if q[0] != job_id] if (
        queued and ended) else []
    if squeue and ended and task is not None and task != job_id:
        task_state = squeue(task)
        if task_state in LIVE_STATES:
            waiting.append((task, task_state))
    if waiting:  # launched again, not started yet: the job in the queue
        job_id, slurm_state = waiting[0]
        if not state.startswith(GOES_ON):  # it had ended: the new job trains on
            state = f"{LAUNCHED_AGAIN} (before: {state})"
    slurm_reason = reason(job_id) if reason and job_id and slurm_state == "PENDING" else None
    book = ledger_mod.ledger(events, metrics, _job_times(events, sacct) if sacct else [])
    exp_name, max_steps = files.recorded(run)
    return Status(
        run_dir=str(run.root), exp_name=exp_name, state=state,
        slurm_state=slurm_state, slurm_reason=slurm_reason, job_id=job_id,
        step=step, max_steps=max_steps, starts=len(runs),
        restarts_by_cause=dict(causes), last_checkpoint=last_ckpt, invalid_checkpoints=invalid,
        steps_lost=ledger_mod.steps_lost(events, metrics),
        checkpoint_stall_seconds=book.causes["checkpoint_stall"],
        checkpoint_write_seconds=round(write_s, 3),
        restore_seconds=round(restore_s, 3), wall_seconds=round(book.wall_seconds, 1),
        goodput=book.effective_share, last_error=last_error,
        requeue_decisions=[{**e, "job_id": _slurm_names(events).get(str(e["job_id"]),
                                                                     e["job_id"])}
                           if e.get("job_id") else e for e in events
                           if e.get("event") in ("requeue", "no_requeue", "restart_in_job")],
        hangs=[{k: v for k, v in e.items() if k != "stacks"} for e in events
               if e.get("event") == "hang"],
        stragglers=list({e.get("rank"): e for e in events
                         if e.get("event") == "straggler"}.values()),
        interruption=phases.last_interruption(events, metrics,
                                              killed=state.startswith("killed")),
        ledger=book.to_dict(),
        skipped_records=skipped_events + skipped_metrics + garbled[0],
        excluded_nodes=read_bad_nodes(run),
        persisted_snapshots=files.persisted_snapshots(run),
        failed_checkpoints=_failed_since_commit(events),
        profile=next(({k: v for k, v in e.items() if k not in ("event", "host")}
                      for e in reversed(events) if e.get("event") == "profile"), None),
    )


def slurm_job(path: str | Path) -> str | None:
    """slurm_job is how to name the run's newest SLURM job to SLURM (ARRAYID_TASKID for a
    sweep's trial), or None when the run was never started by a job."""
    run = RunDir(Path(path))
    problem = run.problem()
    if problem:
        raise StatusError(problem)
    events, _ = well_formed(read_jsonl(run.events), needs_time=True)
    return _newest_job(events)


MAX_JOBS_ASKED = 20  # a run launched again and again by hand: its newest jobs' queue times


def _job_times(events: list[dict[str, Any]], sacct) -> list[ledger_mod.JobTimes]:
    """_job_times is SLURM's times of every job that ran the run (each array task by its own
    name, not the whole array), newest first until one gives none (accounting off, or the
    older jobs purged from it); not the job queued now, which has not started the run."""
    named = _slurm_names(events)
    names = list(dict.fromkeys(named.get(str(e["job_id"]), str(e["job_id"])) for e in events
                               if e.get("job_id") and e.get("event") != "cancel"))
    rows: list[ledger_mod.JobTimes] = []
    for name in reversed(names[-MAX_JOBS_ASKED:]):
        times = sacct(name)
        if not times:
            break
        rows += [ledger_mod.JobTimes(*t) for t in times]
    return rows


def _slurm_names(events: list[dict[str, Any]]) -> dict[str, str]:
    """_slurm_names maps an array task's SLURM_JOB_ID to its name, ARRAYID_TASKID, as the
    trainer recorded both: the job script's own records have the job id only, and SLURM
    answers for the task by its name (its SLURM_JOB_ID may be the whole array's id)."""
    return {str(e["job_id"]): str(e["array_task"]) for e in events
            if e.get("job_id") and e.get("array_task")}


def _newest_job(events: list[dict[str, Any]]) -> str | None:
    """_newest_job is the newest job that started the run, by its SLURM name, or None. A
    `cancel` record names a job that may never have started it (a relaunch cancelled in the
    queue): it counts only where no job started the run."""
    started = [e for e in events if e.get("job_id") and e.get("event") != "cancel"]
    job_id = next((str(e["job_id"]) for e in reversed(started or events) if e.get("job_id")),
                  None)
    return _slurm_names(events).get(job_id, job_id) if job_id else None


RESTARTS = {"requeue": "requeued", "restart_in_job": "restarted in the job"}
TRAINERLESS = "failed before the trainer started"
"""A start of the job that ended before its trainer recorded anything (the container did not
start, an import failed): the job script's decision is its only record (phases.trainerless)."""


CONTINUED = "continued after finishing"
"""The cause of an attempt that finished, continued by a launch with more steps: no restart."""


def _cause(attempt: list[dict[str, Any]]) -> str:
    """_cause names why an attempt that another one followed ended: a hang, a failed health
    check, its stop, crash or error, its finish (a finished run continued with more steps), a
    start that never began training, a start of the job before its trainer recorded anything,
    or a kill that left no record. A `pyrecover cancel` of the attempt's own job comes first:
    its SIGTERM ended the attempt as a stop would, and the user started the run again."""
    if _cancelled(attempt):
        return "cancelled"
    if phases.trainerless(attempt):
        return TRAINERLESS
    if any(e.get("event") == "hang" for e in attempt):
        return "hang"
    if any(_health_failed(e) for e in attempt):  # exit 77, before training
        return "health check failed"
    for e in reversed(attempt):
        kind = e.get("event")
        if kind == "stop":
            reason = str(e.get("reason", "signal"))
            return "time limit" if reason == "deadline" else f"stop ({reason})"
        if kind in ("crash", "snapshot_persisted"):
            return "crash"
        if kind == "error":
            return "error"
        if kind == "finish":
            return CONTINUED
    if not any(e.get("event") in ("start", "resume") for e in attempt):
        return "ended during start-up"
    return "killed (no record)"


RUNNING_OR_KILLED = "running or killed"  # (where the lock cannot tell which: no locks, or
# a free lock last held from another host, whose flock may be node-local and unseen here)


KILLED = "killed (no end recorded)"
STARTING = "starting up"  # a first start that has not recorded its start yet (the lock tells)
LAUNCHED_AGAIN = "launched again"  # a run that had ended (finished, cancelled...) with a new job
GOES_ON = ("stopped", "not started", "running", STARTING, RUNNING_OR_KILLED)  # a job resumes it


def _state(events: list[dict[str, Any]]) -> str:
    decided = False  # the job script ended the attempt (requeue, restart in the job)
    restarted = False  # a process started after it (starting up: the lock tells)
    for i in range(len(events) - 1, -1, -1):
        e = events[i]
        kind = e.get("event")
        if kind == "phase" and e.get("phase") == "process_start" and not decided:
            restarted = True
        if kind in ("requeue", "restart_in_job") and not restarted:
            decided = True
        if kind == "finish":
            return "finished"
        if kind == "stop":  # a job requeues itself; a run started by hand waits for its user
            return "stopped (will resume)" if e.get("job_id") else \
                "stopped (resumes when started again)"
        if kind == "error":
            return "error"
        if kind == "crash":
            return "crashed"
        if kind == "hang":  # the watchdog ended it (exit 76); `hang` lines say where
            return "hung"
        if _health_failed(e):  # exit 77, before training (a job excludes the node, requeues)
            return "health check failed"
        if kind == "no_requeue":
            return "ended: " + str(e.get("reason", ""))
        if kind == "cancel":
            return "cancelled"
        if kind in ("start", "resume"):  # with no end of the trainer's own after it
            if _cancelled_before(events[:i], e.get("job_id")):
                return "cancelled"
            return KILLED if decided else RUNNING_OR_KILLED
    return STARTING if restarted else "not started"


def _cancelled(attempt: list[dict[str, Any]]) -> bool:
    """_cancelled: the attempt holds a `cancel` of the job one of its own records names."""
    jobs = {str(e["job_id"]) for e in attempt if e.get("job_id") and e.get("event") != "cancel"}
    return any(e.get("event") == "cancel" and str(e.get("job_id")) in jobs for e in attempt)


def _cancelled_before(before: list[dict[str, Any]], job_id: Any) -> bool:
    """_cancelled_before: `pyrecover cancel` took this attempt's job while it started up,
    before its start record (SLURM's KillWait may then end it before it records its stop):
    a cancel of the same job since the job script's last decision."""
    for e in reversed(before):
        if e.get("event") in phases.JOB_SCRIPT_EVENTS and e.get("event") != "cancel":
            return False
        if e.get("event") == "cancel":
            return job_id is not None and str(e.get("job_id")) == str(job_id)
    return False


def _health_failed(e: dict[str, Any]) -> bool:
    return e.get("event") == "health" and e.get("ok") is False


def _error_of(e: dict[str, Any]) -> Any:
    """_error_of is an `error` or `crash` event's error, or a failed health check's line."""
    if _health_failed(e):
        rank = e.get("rank")
        return Failure(str(e.get("check")), str(e.get("node")),
                       rank if isinstance(rank, int) else -1,
                       str(e.get("error"))).line().removeprefix("pyrecover: ")
    return e.get("error")


def _failed_since_commit(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """_failed_since_commit: the `checkpoint_failed` records after the newest `checkpoint`."""
    committed = max((i for i, e in enumerate(events) if e.get("event") == "checkpoint"),
                    default=-1)
    return [e for e in events[committed + 1:] if e.get("event") == "checkpoint_failed"]
