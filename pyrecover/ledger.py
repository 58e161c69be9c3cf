"""The goodput ledger: a run's wall time across all its requeues, by cause.

A pure function over the run's records (events.jsonl, metrics.jsonl) and, where SLURM
answered, each job attempt's queue times (passed in; nothing here runs a command). Each
attempt (one process start, phases.py) is cut into spans that do not overlap:

- `queue_wait`: SLURM's submit (or requeue) to start of an attempt, after the previous
  attempt's last record;
- `start_up`: process start to checkpoint chosen, and restored (or chosen) to the end of the
  first step (interpreter, imports, process group, data, model, the first step's warm-up);
  a start that ended before it chose (a failed health check), to its newest start-up phase;
- `restore`: checkpoint chosen to restored;
- `checkpoint_stall`: the seconds saves blocked the loop, and the stop checkpoint;
- `lost_work`: steps computed but not saved before an interruption, redone after it;
- `productive`: the rest of the training span, which ends where a hung phase began (a
  `hang` event's time less its seconds): a hang's wait is no training;
- `idle`: from an attempt that ended with nothing to start it again (it finished, was
  refused or cancelled; or it stopped, crashed, hung or was killed with no record outside a
  job, or in a job that neither its script nor SLURM started again, so only its user
  started it again: by hand, or as a new job) to the next launch (its submit, where
  SLURM gave times, else its start): a finished run extended days later was no less
  productive for the days;
- `remainder`: everything else (stopping, exit, the scheduler's requeue delay where SLURM gave
  no times, gaps without records inside a job): the wall time minus all of the above.

The causes add up to `wall_seconds`, the first record (or submit) to the last. The
effective share is productive over `launched_seconds`: the wall time less `idle`.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pyrecover.phases import attempts
from pyrecover.records import well_formed

CAUSES = ("queue_wait", "start_up", "restore", "checkpoint_stall", "lost_work", "productive",
          "idle", "remainder")
FOR_GOOD = ("finish", "error", "no_requeue", "cancel")
"""Ends after which nothing starts the run again: the time to its next launch is `idle`. So
does any other end of an attempt outside a job (a Ctrl-C's stop, a crash, a hang, a kill that
left no record), or in a job the next attempt is not of: only a person starts it again."""
ENDS = (*FOR_GOOD, "stop", "crash", "hang", "requeue", "restart_in_job")
"""Every event that ends an attempt. The newest of an attempt's decides: after a requeue or an
in-job restart, or a job's stop, crash, hang or kill with no record that the same job
started again (SLURM requeues a job whose node was lost), the gap is the remainder's."""


STARTING = ("imports_done", "data_ready", "group_up")
"""The start-up phases before the checkpoint is chosen."""


@dataclass(frozen=True)
class JobTimes:
    """One attempt of a SLURM job as `sacct --duplicates` reports it (epoch seconds)."""

    submit: float
    start: float
    end: float | None = None  # None while it runs


@dataclass
class Ledger:
    wall_seconds: float = 0.0
    causes: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CAUSES, 0.0))
    effective_share: float | None = None
    """productive / launched_seconds."""
    launched_seconds: float = 0.0
    """wall_seconds less `idle`: the time something was launched to train the run."""
    queue_from_slurm: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _span(a: float | None, b: float | None) -> float:
    return max(0.0, b - a) if a is not None and b is not None else 0.0


def _phase(attempt: list[dict[str, Any]], name: str) -> float | None:
    return next((float(e["time"]) for e in attempt
                 if e.get("event") == "phase" and e.get("phase") == name), None)


def _first_event(attempt: list[dict[str, Any]], *kinds: str) -> float | None:
    return next((float(e["time"]) for e in attempt if e.get("event") in kinds), None)


def _hung_from(attempt: list[dict[str, Any]]) -> float:
    """_hung_from: where the first hung phase of an attempt began (its watchdogs fired), or
    infinity where none hung."""
    began = [float(e["time"]) - float(e.get("seconds") or 0.0) for e in attempt
             if e.get("event") == "hang" and "time" in e]
    return min(began, default=float("inf"))


def _ended_for_good(attempt: list[dict[str, Any]], following: list[dict[str, Any]]) -> bool:
    """_ended_for_good: nothing was left to start the run again after this attempt: it ended
    for good; or no job script's decision restarted it, and it ran outside a job (no record
    of it names one) or in a job that `following`, the next attempt, is not of."""
    last = next((e for e in reversed(attempt) if e.get("event") in ENDS), None)
    if last is not None and last["event"] in FOR_GOOD:
        return True
    if last is not None and last["event"] in ("requeue", "restart_in_job"):
        return False
    mine = _job_ids(attempt)
    return not mine or not mine & _job_ids(following)


def _job_ids(attempt: list[dict[str, Any]]) -> set[str]:
    return {str(e["job_id"]) for e in attempt if e.get("job_id")}


def _times(records: list[dict[str, Any]]) -> list[float]:
    return [float(r["time"]) for r in records if "time" in r]


def _stall(attempt: list[dict[str, Any]], metrics: list[dict[str, Any]], until: float) -> float:
    """_stall: the loop's blocked seconds as the attempt's newest count up to `until` gave
    them (a metrics row's; the trainer's own at its finish, or when its ranks agreed to stop),
    plus the checkpoints committed after that count (their own `blocked`, each its share of
    the loop's stall, its commit included) up to `until`."""
    counted = [r for r in (*metrics, *attempt) if "checkpoint_stall_total" in r
               and "time" in r and float(r["time"]) <= until]
    since, total = float("-inf"), 0.0
    if counted:  # a tie (the times' milliseconds): the later count is the larger
        newest = max(counted, key=lambda r: (float(r["time"]), float(r["checkpoint_stall_total"])))
        since, total = float(newest["time"]), float(newest["checkpoint_stall_total"])
    for e in attempt:
        if e.get("event") == "checkpoint" and since < float(e["time"]) <= until:
            total += float(e.get("blocked", e.get("seconds", 0.0)))
    return total


@dataclass(frozen=True)
class _Trained:
    """What one attempt computed: from the step it started or resumed at to the highest step
    its records show (None for an attempt that never began training)."""

    began: int | None
    reached: int


def _began(e: dict[str, Any]) -> int | None:
    if e.get("event") == "start":
        return 0
    return int(e["step"]) if "step" in e else None  # a resume of old records may lack it


def _trained(runs: list[list[dict[str, Any]]], windows: list[list[dict[str, Any]]]
             ) -> list[_Trained]:
    out = []
    for attempt, mine in zip(runs, windows, strict=True):
        began = next((_began(e) for e in attempt if e.get("event") in ("start", "resume")),
                     None)
        steps = [int(r["step"]) for r in mine if "step" in r] + [
            int(e["step"]) for e in attempt
            if "step" in e and e.get("event") in ("checkpoint", "stop", "finish")]
        out.append(_Trained(began, max([began or 0, *steps])))
    return out


def _redone_from(trained: list[_Trained]) -> list[int | None]:
    """_redone_from[i]: the lowest step a later attempt began training at (a start is step
    0), or None: attempt i's steps above it were computed again."""
    out: list[int | None] = []
    low: int | None = None
    for t in reversed(trained):
        out.append(low)
        if t.began is not None:
            low = t.began if low is None else min(low, t.began)
    return out[::-1]


def _lost_steps(t: _Trained, redone_from: int | None) -> int:
    if t.began is None or redone_from is None:
        return 0
    return max(0, t.reached - max(redone_from, t.began))


def _windows(runs: list[list[dict[str, Any]]], metrics: Sequence[dict[str, Any]]
             ) -> tuple[list[float], list[list[dict[str, Any]]]]:
    """_windows: each attempt's start and the metrics rows written from it to the next."""
    starts = [_phase(a, "process_start") or min(_times(a)) for a in runs]
    windows: list[list[dict[str, Any]]] = [[] for _ in runs]
    if starts == sorted(starts):  # (always, but for clocks that part): one pass, a bisect each
        for m in metrics:
            if "time" in m and (i := bisect.bisect_right(starts, float(m["time"])) - 1) >= 0:
                windows[i].append(m)
        return starts, windows
    for i, started in enumerate(starts):
        following = starts[i + 1] if i + 1 < len(runs) else float("inf")
        windows[i] = [m for m in metrics
                      if "time" in m and started <= float(m["time"]) < following]
    return starts, windows


def _job_of(jobs: Sequence[JobTimes], after: float, started: float) -> JobTimes | None:
    """_job_of: the SLURM attempt that started this one, the newest start in the gap before it
    (one per attempt, so rows that overlap, such as a whole array's, count once)."""
    inside = [j for j in jobs if after <= j.start <= started]
    return max(inside, key=lambda j: j.start, default=None)


def ledger(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]],
           jobs: Sequence[JobTimes] = ()) -> Ledger:
    """ledger accounts for a run's wall time by cause (see the module's docstring)."""
    runs = attempts(list(events))
    records = _times(list(events)) + _times(list(metrics))
    if not runs or not records:
        return Ledger()
    causes = dict.fromkeys(CAUSES, 0.0)
    starts, windows = _windows(runs, metrics)
    trained = _trained(runs, windows)
    redone_from = _redone_from(trained)
    previous_end, used = min(records), []
    for i, (attempt, mine) in enumerate(zip(runs, windows, strict=True)):
        started = starts[i]
        following = starts[i + 1] if i + 1 < len(runs) else float("inf")
        last = max(_times(attempt) + _times(mine))
        job = _job_of(jobs, float("-inf") if i == 0 else previous_end, started)
        if i > 0 and _ended_for_good(runs[i - 1], attempt):  # launched again by someone
            causes["idle"] += _span(previous_end, job.submit if job is not None else started)
        if job is not None:  # the queue wait that led to this attempt, after the one before
            used.append(job)
            queued_from = job.submit if i == 0 else max(job.submit, previous_end)
            causes["queue_wait"] += _span(queued_from, min(job.start, started))
        chosen, restored = _phase(attempt, "checkpoint_chosen"), _phase(attempt, "restored")
        first = _phase(attempt, "first_step")
        if first is None and chosen is None:  # records from before phase timings
            first = _first_event(attempt, "start", "resume")
        # A start that ended before it chose (a failed health check, out of memory building
        # the model) spent its time to its newest start-up phase starting up.
        reached = chosen if chosen is not None or first is not None else max(
            (t for name in STARTING if (t := _phase(attempt, name)) is not None), default=None)
        causes["start_up"] += _span(started, reached) + _span(restored or chosen, first)
        causes["restore"] += _span(chosen, restored)
        agreed, saved = _phase(attempt, "stop_agreed"), _phase(attempt, "save_done")
        ends = _times(mine) + [t for t in (_first_event(attempt, "finish"), first) if t]
        train_end = agreed if agreed is not None else max(ends, default=None)
        if train_end is not None:  # an attempt's records past the next one's start: its own
            train_end = min(train_end, following, _hung_from(attempt))
        training = _span(first, train_end)
        # No sign that training began (an attempt that ended during start-up): no stall.
        stall = min(training, _stall(attempt, mine, train_end)) if train_end is not None else 0.0
        causes["checkpoint_stall"] += stall + _span(
            agreed, min(saved, following) if saved is not None else None)
        lost = 0.0
        # A later attempt that began training at or below where this one began redid all of
        # it (a start from step 0 after no checkpoint survived, an older checkpoint chosen);
        # one that began above that, the steps of this one past its step.
        t, low = trained[i], redone_from[i]
        if t.began is not None and low is not None and low <= t.began:
            lost = training - stall
        elif (steps := _lost_steps(t, low)):
            step_times = [float(m["step_time"]) for m in mine if "step_time" in m]
            if step_times:
                lost = min(training - stall, steps * statistics.median(step_times))
        causes["lost_work"] += lost
        causes["productive"] += training - stall - lost
        previous_end = max(previous_end, last)
    begin = min(records + [j.submit for j in used])
    end = max(records + [j.end for j in used[-1:] if j.end is not None])
    wall = round(end - begin, 3)
    causes = {k: round(v, 3) for k, v in causes.items()}
    causes["remainder"] = round(wall - sum(v for k, v in causes.items() if k != "remainder"), 3)
    launched = round(wall - causes["idle"], 3)
    return Ledger(wall_seconds=wall, causes=causes, launched_seconds=launched,
                  effective_share=round(causes["productive"] / launched, 4) if launched > 0
                  else None, queue_from_slurm=bool(jobs))


def steps_lost(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]]) -> int:
    """steps_lost counts the steps computed and then computed again: of every attempt, those
    past the lowest step a later attempt began training at (the checkpoint it resumed
    from; a start from step 0 after no checkpoint survived), as the ledger's `lost_work`
    counts their time."""
    runs = attempts(list(events))
    if not runs:
        return 0
    trained = _trained(runs, _windows(runs, metrics)[1])
    return sum(_lost_steps(t, low) for t, low in zip(trained, _redone_from(trained),
                                                     strict=True))


def steps_redone(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]],
                 step: int) -> int:
    """steps_redone: what a resume at `step` computes again: the steps past it that the newest
    attempt which trained had reached (what older attempts reached past it was counted at
    the resume that followed them). Reads the records as they are in the run directory."""
    events, metrics = well_formed(events, True)[0], well_formed(metrics, False)[0]
    runs = attempts(list(events))
    if not runs:
        return 0
    last = next((t for t in reversed(_trained(runs, _windows(runs, metrics)[1]))
                 if t.began is not None), None)
    return max(0, last.reached - step) if last is not None else 0
