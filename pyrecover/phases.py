"""Phase timestamps of every start and stop, as `phase` events in events.jsonl.

A start records `process_start` (the process's own start time, read from the kernel),
`imports_done`, `data_ready`, `group_up`, `checkpoint_chosen`, `restored` (resumes only) and
`first_step`; a stop records `signal_seen` (the time the signal handler set its flag),
`stop_agreed`, `save_done` and `exit`. Times are wall-clock seconds (`time.time()`), so the
phases of one attempt and of the next line up across requeues and hosts with synchronized
clocks. Only rank 0 writes; marks made before the run directory exists are kept and written
when it does. This module imports nothing else from the project but `rundir`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from pyrecover.rundir import RunDir

START_PHASES = ("process_start", "imports_done", "data_ready", "group_up", "checkpoint_chosen",
                "restored", "first_step")
STOP_PHASES = ("signal_seen", "stop_agreed", "save_done", "exit")
# What the job script records after its training step ended: no sign of the trainer's life.
JOB_SCRIPT_EVENTS = ("requeue", "no_requeue", "restart_in_job", "cancel")
# Records that say an attempt is over without a stop of its own (a crash, a hang, or the job
# script's decision after it died): its interruption is the newest, restarted or not.
ENDED = ("crash", "hang", "requeue", "no_requeue", "restart_in_job")
PHASES = START_PHASES + STOP_PHASES
# What `checkpoint_chosen` also records (seconds): the model and optimizer built, the
# background checksum pass beside them, and rank 0's wait for that pass once they were.
CHOICE_TIMES = ("built_s", "verify_s", "wait_s")

_IMPORTED_AT = time.time()  # fallback start time where /proc is not there


def process_start_time(pid: str = "self") -> float:
    """process_start_time is when this process started, in epoch seconds (10 ms resolution).

    /proc/<pid>/stat field 22 is the start in clock ticks after boot; /proc/uptime says how
    long ago the boot was. Without /proc: when this module was imported.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
        # The command name (field 2) may hold spaces and parentheses; fields follow the last ')'.
        ticks = int(stat[stat.rindex(")") + 2:].split()[19])
        started = now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return _IMPORTED_AT
    return min(started, _IMPORTED_AT)


class Phases:
    """Phases records phase events on rank 0 (every other rank's marks are dropped)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.run: RunDir | None = None
        self._pending: list[tuple[str, float, dict[str, Any]]] = []
        self.seen: dict[str, float] = {}

    def mark(self, phase: str, at: float | None = None, **fields: Any) -> None:
        """mark records that `phase` happened at `at` (now when None)."""
        if self.rank != 0:
            return
        at = time.time() if at is None else at
        self.seen[phase] = at
        if self.run is None:
            self._pending.append((phase, at, fields))
        else:
            self.run.event("phase", phase=phase, time=round(at, 3), **fields)

    def attach(self, run: RunDir) -> None:
        """attach starts writing to `run` (which exists now), first the marks held back."""
        if self.rank != 0:
            return
        self.run = run
        pending, self._pending = self._pending, []
        for phase, at, fields in pending:
            run.event("phase", phase=phase, time=round(at, 3), **fields)

    def once(self, phase: str, fields: Callable[[], dict[str, Any]] | None = None) -> None:
        """once marks `phase` the first time it is called on rank 0, with the `fields` it
        returns then (called that once only)."""
        if self.rank == 0 and phase not in self.seen:
            self.mark(phase, **(fields() if fields is not None else {}))


def _time(e: dict[str, Any]) -> float:
    t = e.get("time")
    return float(t) if type(t) in (int, float) else float("-inf")


def _opens(e: dict[str, Any]) -> bool:
    """_opens: a record only the start of an attempt writes."""
    return (e.get("event") == "phase" and e.get("phase") == "process_start") or e.get(
        "event") in ("start", "resume")


def attempts(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """attempts splits events (in file order) into one list per process start: at each
    `process_start` phase, or (records older than phase timings) at a `start` or `resume`
    in an attempt that already has one.

    Rank 0 writes its start-up phases once the run directory is open (Phases.attach), with
    the times they happened: another rank's record (a failed health check) can come first in
    the file. Records that open no attempt and came after this process started are its own,
    not an attempt of theirs (nor of the attempt before, whose last records they follow)."""
    out: list[list[dict[str, Any]]] = [[]]
    for e in events:
        kind = e.get("event")
        begins = (kind == "phase" and e.get("phase") == "process_start") or (
            kind in ("start", "resume") and any(x.get("event") in ("start", "resume")
                                                 for x in out[-1]))
        ours = kind == "phase" and not any(_opens(x) for x in out[-1]) and all(
            _time(x) >= _time(e) for x in out[-1])
        if begins and out[-1] and not ours:
            out.append(_written_early(out[-1], e) if kind == "phase" else [])
        out[-1].append(e)
    return [a for a in out if a]


DECISIONS = ("requeue", "restart_in_job", "no_requeue")
"""The job script's records of how a step of the job ended (slurm/blocks.py)."""


def trainerless(attempt: list[dict[str, Any]]) -> bool:
    """trainerless: the job script's records alone, none of the trainer's."""
    return all(e.get("event") in JOB_SCRIPT_EVENTS for e in attempt)


def job_attempts(attempts: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """job_attempts: every start of the run, in order: the trainer's (`attempts`), and each
    start of the job that ended before its trainer recorded anything, the job script's
    decision alone, which `attempts` leaves in the attempt before it (or alone). A
    `pyrecover cancel` record alone is no start."""
    out = []
    for attempt in attempts:
        chunk: list[dict[str, Any]] = []
        for e in attempt:
            chunk.append(e)
            if e.get("event") in DECISIONS:  # the end of a step of the job
                out.append(chunk)
                chunk = []
        if chunk and not trainerless(chunk):
            out.append(chunk)
    return out


def _written_early(before: list[dict[str, Any]], start: dict[str, Any]) -> list[dict[str, Any]]:
    """_written_early takes off the end of `before` (in place) the records another rank wrote
    after `start`'s process started, ahead of its held-back phases, and returns them."""
    cut = len(before)
    while cut > 0 and not _opens(before[cut - 1]) and before[cut - 1].get(
            "event") not in JOB_SCRIPT_EVENTS and _time(before[cut - 1]) >= _time(start):
        cut -= 1
    moved = before[cut:]
    del before[cut:]
    return moved


def _phase_rows(attempt: list[dict[str, Any]], names: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    for e in attempt:
        if e.get("event") == "phase" and e.get("phase") in names:
            row = {"phase": e["phase"], "time": float(e["time"])}
            for key in CHOICE_TIMES:  # checkpoint_chosen: where its seconds went
                if type(e.get(key)) in (int, float):
                    row[key] = float(e[key])
            cache = e.get("compile_cache")
            if isinstance(cache, dict) and all(type(cache.get(k)) is int
                                               for k in ("hits", "misses")):
                row["compile_cache"] = {k: cache[k] for k in ("hits", "misses")}
            rows.append(row)
    return rows


def last_interruption(events: list[dict[str, Any]], metrics: Sequence[dict[str, Any]] = (),
                      killed: bool = False) -> list[dict[str, Any]]:
    """last_interruption lists the phases of the newest interruption in order: how the attempt
    ended (its stop phases, or `last_record` after a crash or kill: its newest event or step
    metric, not what the job script recorded after it) and how the next one started, each
    with `gap`, the seconds since the row before. An attempt that stopped, crashed or was
    killed (the job script's decision recorded after it) and has not started again yet shows
    how it ended only. Empty when there was none."""
    runs = attempts(events)
    if not runs:
        return []
    last = runs[-1]
    if killed or _phase_rows(last, ("stop_agreed",)) or any(e.get("event") in ENDED
                                                            for e in last):
        ended, started = last, []
    elif len(runs) > 1:
        ended, started = runs[-2], runs[-1]
    else:
        return []
    rows = _phase_rows(ended, STOP_PHASES)
    if not rows:  # crashed or killed: the attempt's last sign of life
        began = min((float(e["time"]) for e in ended if "time" in e), default=None)
        until = min((float(e["time"]) for e in started if "time" in e), default=float("inf"))
        lives = [float(e["time"]) for e in ended if "time" in e
                 and e.get("event") not in JOB_SCRIPT_EVENTS]
        lives += [float(m["time"]) for m in metrics if "time" in m and began is not None
                  and began <= float(m["time"]) < until]
        last = max(lives, default=None)
        rows = [{"phase": "last_record", "time": last}] if last is not None else []
    rows += _phase_rows(started, START_PHASES)
    previous = None
    for row in rows:
        row["gap"] = round(row["time"] - previous, 3) if previous is not None else 0.0
        previous = row["time"]
    return rows


def failure_to_first_step(events: list[dict[str, Any]]) -> float | None:
    """failure_to_first_step is the seconds from the newest failure to the first step after
    it: from the failed attempt's first `crash`, `hang` or failed `health` record (where it
    left none, e.g. a SIGKILLed task, the job script's `restart_in_job` or `requeue`
    decision) to the next attempt's `first_step` phase. None if there is no such pair."""
    decided = [i for i, e in enumerate(events) if e.get("event") in ("restart_in_job", "requeue")]
    if not decided:
        return None
    d = decided[-1]
    first = next((e for e in events[d:] if e.get("event") == "phase"
                  and e.get("phase") == "first_step"), None)
    if first is None:
        return None
    begin = max((i for i, e in enumerate(events[:d]) if e.get("event") == "phase"
                 and e.get("phase") == "process_start"), default=0)
    failed = [float(e["time"]) for e in events[begin:d] if e.get("event") in ("crash", "hang")
              or (e.get("event") == "health" and e.get("ok") is False)]
    return float(first["time"]) - (min(failed) if failed else float(events[d]["time"]))
