"""`checkpoint.interval: auto`: the Young/Daly interval from what this run has measured.

Checkpointing every `sqrt(2 x stall x MTBF)` seconds minimizes the expected time lost to
stalls plus recomputation (Young 1974; Daly 2006 for the first-order form). `stall` is the
seconds a save blocks the loop, as measured; MTBF is the mean time between failures this
run has seen, starting from a prior (`checkpoint.mtbf_hours`) that counts as one failure-free
period: `(prior + observed) / (1 + failures)`, so a run that never fails drifts towards
longer intervals and a run that keeps crashing towards shorter ones. The result is bounded
to [MIN_SECONDS, MAX_SECONDS] of training and to [1, max_steps] steps.

Only pure functions and one small stateful tracker; the manager asks it after each commit
and all ranks use rank 0's answer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pyrecover import phases
from pyrecover.records import well_formed

MIN_SECONDS = 10.0  # never save more often: each save also costs storage bandwidth and churn
MAX_SECONDS = 6 * 3600.0  # never risk more than this much recomputation
FIRST_STEPS = 20  # before any save was measured: save soon, to measure one
# Records written between two attempts (the job script's, a start's phases before it trains).
BETWEEN_ATTEMPTS = frozenset({"phase", *phases.JOB_SCRIPT_EVENTS})  # a `cancel` too


def young_daly_seconds(stall_s: float, mtbf_s: float) -> float:
    """young_daly_seconds is sqrt(2 x stall x MTBF), bounded to [MIN_SECONDS, MAX_SECONDS]."""
    raw = math.sqrt(2.0 * max(stall_s, 0.0) * max(mtbf_s, 0.0))
    return min(MAX_SECONDS, max(MIN_SECONDS, raw))


def interval_steps(stall_s: float, step_s: float, mtbf_s: float, max_steps: int) -> int:
    """interval_steps is the Young/Daly interval in optimizer steps of `step_s` seconds."""
    if step_s <= 0:
        return max(1, min(FIRST_STEPS, max_steps))
    steps = round(young_daly_seconds(stall_s, mtbf_s) / step_s)
    return max(1, min(max_steps, steps))


def mtbf(prior_s: float, observed_s: float, failures: int) -> float:
    """mtbf: the prior counts as one failure-free period of `prior_s` seconds."""
    return (prior_s + max(observed_s, 0.0)) / (1 + max(failures, 0))


def failures_seen(events: Iterable[dict[str, Any]],
                  metrics: Iterable[dict[str, Any]] = ()) -> tuple[float, int]:
    """failures_seen: (seconds of training observed, failures) over a run's past attempts.

    The events split into attempts at each process start (`phases.attempts`). A failure is an
    interruption that lost work: a crash, or an attempt that trained and ended
    with no record at all (killed: SIGKILL, a lost node, a preemption whose grace ran out). A
    recorded stop (the time limit, a preemption's SIGTERM, a cancel, USR2) is none: the trainer
    writes it only once the stop checkpoint is committed, so nothing was redone, and the
    Young/Daly rule prices only what a failure makes the run compute again. Every attempt
    in `events` is over (a start reads them before it writes its own `start` or `resume`),
    the last one too: its failure counts at once. An attempt's time runs from its `start` or
    `resume` to its last record after that, a metrics row included (a killed attempt's last
    event may be its newest checkpoint, long before it died); what it wrote before (health
    checks, snapshots recovered, start-up phases) and what the job script wrote after it
    (requeue decisions) is time between attempts, not observed training. An attempt that
    never began training (killed or refused during start-up) lost no training and counts
    neither way. Records without a numeric time are left out.
    """
    runs = phases.attempts(well_formed(events, needs_time=True)[0])
    begins = [next((float(e["time"]) for e in a if e.get("event") in ("start", "resume")),
                   None) for a in runs]
    rows = sorted(float(m["time"]) for m in well_formed(metrics, needs_time=True)[0])
    observed, failures = 0.0, 0
    for i, attempt in enumerate(runs):
        began = begins[i]
        if began is None:
            continue
        following = min([b for b in begins[i + 1:] if b is not None], default=math.inf)
        last, ended_well = began, False
        for e in attempt:
            kind, at = e.get("event"), float(e["time"])
            if at < began or kind in BETWEEN_ATTEMPTS:
                continue
            if kind in ("stop", "finish", "error"):  # an error: the input's, no retry helps
                ended_well = True
            if kind == "crash":
                ended_well = False
            last = max(last, at)
        last = max([last, *(t for t in rows if began <= t < following)])
        observed += last - began
        failures += not ended_well
    return observed, failures


@dataclass(frozen=True)
class Clock:
    """Where the interval counts from: a save's start (or the attempt's first step), the time
    then (perf_counter) and the loop's checkpoint stall until then."""

    step: int
    time: float
    stall: float


@dataclass
class AutoInterval:
    """The running estimate: step time and stall as measured by rank 0, and the MTBF."""

    mtbf_s: float
    max_steps: int
    step_s: float = 0.0
    stall_s: float = 0.0
    steps: int = FIRST_STEPS
    clock: Clock | None = None  # the newest save's start, or the attempt's first step

    def begin(self, clock: Clock) -> None:
        """begin starts the count at the attempt's first step boundary."""
        if self.clock is None:
            self.clock = clock

    def due(self, step: int, interval: int) -> bool:
        """due: `interval` steps after the newest save began, not after it committed (counted
        from the commit, a save still being written made the very next step due as well,
        which then waited for the write and saved again)."""
        return self.clock is not None and step - self.clock.step >= interval

    def started(self, clock: Clock) -> tuple[Clock | None, Clock]:
        """started moves the count to a save that begins at `clock`; returns (the clock it
        counted from, `clock`), for `observe_steps` once that save is committed."""
        since, self.clock = self.clock, clock
        return since, clock

    def observe_steps(self, since: Clock | None, until: Clock | None) -> None:
        """observe_steps folds in the mean step time between two clocks, less whatever the
        checkpoints blocked the loop for in between."""
        if since is not None and until is not None and until.step > since.step:
            training = (until.time - since.time) - (until.stall - since.stall)
            self.observe_step(max(0.0, training) / (until.step - since.step))

    def observe_step(self, seconds: float) -> None:
        """observe_step folds one step's time in (the mean of recent steps, outliers damped)."""
        if seconds > 0:
            self.step_s = seconds if self.step_s == 0 else 0.9 * self.step_s + 0.1 * seconds

    def observe_stall(self, seconds: float) -> None:
        """observe_stall takes the newest save's blocked seconds (the slower of it and the
        previous, decayed, so one fast save does not shorten the interval at once)."""
        self.stall_s = max(seconds, 0.8 * self.stall_s)

    def propose(self) -> int:
        return interval_steps(self.stall_s, self.step_s, self.mtbf_s, self.max_steps)


def for_config(interval: int | str, mtbf_hours: float, max_steps: int,
               events: Iterable[dict[str, Any]], metrics: Iterable[dict[str, Any]] = (),
               ) -> tuple[int, AutoInterval | None]:
    """for_config: the interval to start with and, for `auto`, its tracker (the MTBF from the
    prior and this run's past `events` and `metrics`; pass them on rank 0, whose choices every
    rank takes)."""
    if interval != "auto":
        return int(interval), None
    observed, failures = failures_seen(events, metrics)
    auto = AutoInterval(mtbf(mtbf_hours * 3600.0, observed, failures), max_steps,
                        steps=max(1, min(FIRST_STEPS, max_steps)))
    return auto.steps, auto
