"""The goodput ledger: a run's wall time across all its requeues, by cause.

A pure function over the run's records (events.jsonl, metrics.jsonl) and, where SLURM
answered, each job attempt's queue times (passed in; nothing here runs a command). Each
attempt (one process start, phases.py) is cut into spans that do not overlap:

- `queue_wait`: SLURM's submit (or requeue) to start of an attempt, after the previous
  attempt's last record;
- `start_up`: process start to checkpoint chosen, and restored (or chosen) to the end of the
  first step (interpreter, imports, process group, data, model, the first step's warm-up);
- `restore`: checkpoint chosen to restored;
- `checkpoint_stall`: the seconds saves blocked the loop, and the stop checkpoint;
- `lost_work`: steps computed but not saved before an interruption, redone after it;
- `productive`: the rest of the training span;
- `remainder`: everything else (stopping, exit, the scheduler's requeue delay where SLURM gave
  no times, gaps without records): the wall time minus all of the above.

The causes add up to `wall_seconds`, the first record (or submit) to the last.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pyrecover.phases import attempts

CAUSES = ("queue_wait", "start_up", "restore", "checkpoint_stall", "lost_work", "productive",
          "remainder")


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
    """productive / wall_seconds."""
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


def _times(records: list[dict[str, Any]]) -> list[float]:
    return [float(r["time"]) for r in records if "time" in r]


def _stall(attempt: list[dict[str, Any]], metrics: list[dict[str, Any]], until: float) -> float:
    """_stall: the loop's blocked seconds as the attempt's newest metric counted them, plus the
    checkpoints committed after that metric (their own `blocked`) up to `until`."""
    counted = [m for m in metrics if "checkpoint_stall_total" in m and "time" in m]
    since, total = float("-inf"), 0.0
    if counted:
        newest = max(counted, key=lambda m: float(m["time"]))
        since, total = float(newest["time"]), float(newest["checkpoint_stall_total"])
    for e in attempt:
        if e.get("event") == "checkpoint" and since < float(e["time"]) <= until:
            total += float(e.get("blocked", e.get("seconds", 0.0)))
    return total


def ledger(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]],
           jobs: Sequence[JobTimes] = ()) -> Ledger:
    """ledger accounts for a run's wall time by cause (see the module's docstring)."""
    runs = attempts(list(events))
    records = _times(list(events)) + _times(list(metrics))
    if not runs or not records:
        return Ledger()
    begin = min(records + [j.submit for j in jobs])
    end = max(records + [j.end for j in jobs if j.end is not None])
    causes = dict.fromkeys(CAUSES, 0.0)
    starts = [_phase(a, "process_start") or min(_times(a)) for a in runs]
    previous_end = begin
    for i, attempt in enumerate(runs):
        started = starts[i]
        following = starts[i + 1] if i + 1 < len(runs) else float("inf")
        mine = [m for m in metrics if "time" in m and started <= float(m["time"]) < following]
        last = max(_times(attempt) + _times(mine))
        for job in jobs:  # the queue wait that led to this attempt, clipped to the gap before it
            if previous_end <= job.start <= started:
                causes["queue_wait"] += _span(max(job.submit, previous_end),
                                              min(job.start, started))
        chosen, restored = _phase(attempt, "checkpoint_chosen"), _phase(attempt, "restored")
        first = _phase(attempt, "first_step")
        if first is None and chosen is None:  # records from before phase timings
            first = _first_event(attempt, "start", "resume")
        causes["start_up"] += _span(started, chosen) + _span(restored or chosen, first)
        causes["restore"] += _span(chosen, restored)
        agreed, saved = _phase(attempt, "stop_agreed"), _phase(attempt, "save_done")
        ends = _times(mine) + [t for t in (_first_event(attempt, "finish"), first) if t]
        train_end = agreed if agreed is not None else max(ends, default=None)
        training = _span(first, train_end)
        # No sign that training began (an attempt that ended during start-up): no stall.
        stall = min(training, _stall(attempt, mine, train_end)) if train_end is not None else 0.0
        causes["checkpoint_stall"] += stall + _span(agreed, saved)
        lost = 0.0
        # The next attempt that began training (one that failed during start-up did not):
        # a resume redid the steps it names; a start from step 0 (no checkpoint survived)
        # lost all of this attempt's training.
        after = next((a for a in runs[i + 1:] if _first_event(a, "start", "resume")), [])
        if _first_event(after, "resume") is not None:
            redone = sum(int(e.get("steps_lost", 0)) for e in after if e.get("event") == "resume")
            step_times = [float(m["step_time"]) for m in mine if "step_time" in m]
            if redone and step_times:
                lost = min(training - stall, redone * statistics.median(step_times))
        elif _first_event(after, "start") is not None:
            lost = training - stall
        causes["lost_work"] += lost
        causes["productive"] += training - stall - lost
        previous_end = last
    wall = round(end - begin, 3)
    causes = {k: round(v, 3) for k, v in causes.items()}
    causes["remainder"] = round(wall - sum(v for k, v in causes.items() if k != "remainder"), 3)
    return Ledger(wall_seconds=wall, causes=causes,
                  effective_share=round(causes["productive"] / wall, 4) if wall > 0 else None,
                  queue_from_slurm=bool(jobs))


def steps_lost(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]]) -> int:
    """steps_lost counts the steps computed and then computed again: each resume's own count
    (its `steps_lost`: past the checkpoint it restored), and at a start from step 0 after
    training (no checkpoint had survived) every step reached since the run last began."""
    records = sorted([(float(e["time"]), 0, e) for e in events if "time" in e]
                     + [(float(m["time"]), 1, m) for m in metrics if "time" in m],
                     key=lambda r: (r[0], r[1]))
    lost = reached = 0
    for _, is_metric, r in records:
        kind = None if is_metric else r.get("event")
        if kind == "resume":
            lost += int(r.get("steps_lost", 0))
            reached = int(r.get("step", 0))
        elif kind == "start":
            lost, reached = lost + reached, 0
        elif "step" in r and (is_metric or kind in ("checkpoint", "stop", "finish")):
            reached = max(reached, int(r["step"]))
    return lost
