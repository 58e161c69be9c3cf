"""Stopping cleanly: signal flags, agreement across ranks, the job's deadline, exit codes.

A signal handler here only sets a flag. At each step boundary the ranks agree with one tiny
all-reduce whether any of them was asked to stop (or rank 0's deadline says the next steps
plus a checkpoint would not fit), so every rank stops after the same step and saves the same
checkpoint; no rank leaves while another is still inside a collective.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Exit codes the job script acts on (see the sbatch template):
EXIT_OK = 0
EXIT_CRASH = 1  # anything unexpected: requeued while restarts remain
EXIT_USER_ERROR = 2  # config or data: requeueing cannot help, never requeued
EXIT_STOPPED = 75  # sysexits' EX_TEMPFAIL: saved cleanly, "run me again"; always requeued
EXIT_HANG = 76  # the hang watchdog fired (pyrecover/watchdog.py): a crash, recorded as `hang`
EXIT_HEALTH = 77  # a task's health check failed (pyrecover/health.py): its node is excluded

DEFAULT_SIGNALS = ("SIGUSR2", "SIGTERM")


class StopRequested(Exception):
    """Raised after the stop checkpoint is committed; the process exits with EXIT_STOPPED.
    `stall` is the seconds saves had blocked the loop when the stop was agreed, before the
    stop checkpoint (the loop's; None where no loop counted them)."""

    def __init__(self, step: int, reason: str, stall: float | None = None) -> None:
        super().__init__(f"stopped after step {step} ({reason}) with a checkpoint; run the same "
                         "command again to resume")
        self.step, self.reason, self.stall = step, reason, stall

    def record(self, flag: StopFlag, mark: Callable[..., Any], event: Callable[..., Any]
               ) -> None:
        """record writes rank 0's records of the stop (`mark`: its phases, `event`: the run's
        events): `signal_seen` where a signal came; `stop_agreed`, with the loop's count of
        checkpoint stall up to there (the ledger's, ledger.py); `save_done`; `stop`."""
        if flag.received_at is not None:
            mark("signal_seen", flag.received_at, signal=flag.reason)
        counted = {} if self.stall is None else {"checkpoint_stall_total": round(self.stall, 5)}
        mark("stop_agreed", flag.agreed_at, reason=self.reason, **counted)
        mark("save_done")
        event("stop", step=self.step, reason=self.reason)


def parse_signal(name: str) -> signal.Signals:
    """parse_signal accepts `USR2`, `SIGUSR2` or a number."""
    text = name.strip().upper()
    if text.isdigit():
        return signal.Signals(int(text))
    if not text.startswith("SIG"):
        text = "SIG" + text
    try:
        return signal.Signals[text]
    except KeyError:
        raise ValueError(f"unknown signal {name!r}") from None


INT_AGAIN_S = 1.0  # a second SIGINT sooner is the same Ctrl-C (reaching a process twice)
CTRL_C = ("pyrecover: Ctrl-C: stopping after this step with a checkpoint; Ctrl-C again to quit "
          "at once without one")


def say(text: str) -> None:
    """say writes `text` to stderr from a signal handler: one write(2), which is
    async-signal-safe, where print() is not (re-entered on a buffered stream, it raises)."""
    try:
        os.write(2, text.encode(errors="replace"))
    except OSError:
        pass


@dataclass
class StopFlag:
    """Set by a signal handler; read at step boundaries. Never does work in the handler, but
    for Ctrl-C: the first SIGINT is a stop like the others (said on the terminal where
    `announce`), a second one (INT_AGAIN_S later) raises KeyboardInterrupt, as Python's own
    handler would: the user wants out now."""

    signum: int | None = None
    received_at: float | None = None
    agreed_at: float | None = None  # when the ranks agreed to stop (set by Stopper.check)
    announce: bool = False
    _old: dict[int, object] = field(default_factory=dict)

    def install(self, signals: tuple[str, ...] = DEFAULT_SIGNALS) -> StopFlag:
        for name in signals:
            sig = parse_signal(name)
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, _frame) -> None:
        now = time.time()
        if self.signum is None:
            self.signum, self.received_at = signum, now
            if signum == signal.SIGINT and self.announce:
                say(f"\n{CTRL_C}\n")
        elif signum == signal.SIGINT and not (
                self.signum == signal.SIGINT and now - (self.received_at or now) < INT_AGAIN_S):
            raise KeyboardInterrupt

    def uninstall(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    @property
    def reason(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum is not None else None


# Caught from the first moment of `pyrecover train` (catch_early): every stop signal a run
# may name (run.stop_signal, config_checks.py) and torchrun's TERM, whose default actions end
# the process. Not SIGINT: Ctrl-C stays immediate. SIGTERM last: a launcher takes a worker
# that catches it for one that catches the others already (spawn.catching).
EARLY_SIGNALS = ("SIGHUP", "SIGXCPU", "SIGUSR1", "SIGUSR2", "SIGTERM")
_early: StopFlag | None = None


def catch_early() -> None:
    """catch_early records the stop signals from the start of a trainer's process (before its
    imports, its data and its health check: seconds), so a preemption during start-up is a
    clean stop at the first step and not a death by the signal, which the job script counts
    as a failure. `take_over` (a trainer) or `end_early` (a launcher) hands what it caught
    on. Idempotent."""
    global _early
    if _early is None:
        _early = StopFlag().install(EARLY_SIGNALS)


def take_over(signals: tuple[str, ...]) -> StopFlag:
    """take_over installs the run's flag for `signals` and ends catch_early's: a signal it
    caught that is one of `signals` is the run's; one that is not is delivered again with the
    handler it had before, as if never caught (USR1 for a run that stops on USR2 still ends
    it, as it always did)."""
    flag = StopFlag().install(signals)
    caught, at, before = end_early(tuple(flag._old))
    flag._old.update(before)  # uninstall restores what was there before either
    if caught is not None:  # (else keep one the flag itself took meanwhile)
        flag.signum, flag.received_at = caught, at
    return flag


def end_early(signals: tuple[int, ...]) -> tuple[int | None, float | None, dict[int, object]]:
    """end_early ends catch_early's catch for a caller that has put its own handlers in for
    `signals`: the other signals it caught get back the handlers they had before it, and a
    signal it caught that is not one of `signals` is delivered again, as if never caught.
    Returns the signal of `signals` it caught (None: none) and when, and the handlers it had
    replaced for `signals`, which the caller restores when done (none where not catching)."""
    global _early
    early, _early = _early, None
    if early is None:
        return None, None, {}
    before = {sig: old for sig, old in early._old.items() if sig in signals}
    for sig, old in early._old.items():
        if sig not in signals:
            signal.signal(sig, old)  # type: ignore[arg-type]
    if early.signum is not None and early.signum not in signals:
        os.kill(os.getpid(), early.signum)
        return None, None, before
    return early.signum, early.received_at, before


def caught_early() -> int | None:
    """caught_early is the signal catch_early caught so far (None: none, or not catching)."""
    return _early.signum if _early is not None else None


def job_end_time(environ: Mapping[str, str]) -> float | None:
    """job_end_time is when the allocation ends (epoch seconds), if anyone told us.

    SLURM sets SLURM_JOB_END_TIME in newer versions; the job script passes
    PYRECOVER_JOB_END_TIME (from `squeue -h -o %e`, queried outside the container) otherwise.
    """
    for key in ("SLURM_JOB_END_TIME", "PYRECOVER_JOB_END_TIME"):
        value = environ.get(key, "").strip()
        if value:
            try:
                end = float(value)
            except ValueError:
                continue
            if end > 0:
                return end
    return None


@dataclass
class Deadline:
    """Predicts whether the next steps plus a checkpoint still fit before the job ends."""

    end_time: float | None
    margin_s: float = 30.0
    """Extra seconds kept free: process exit, filesystem flushes, SLURM's own slack."""
    steps_ahead: int = 2
    step_s: float = 0.0  # slowest recent step
    save_s: float = 0.0  # slowest save so far

    def observe(self, step_s: float, save_s: float = 0.0) -> None:
        # Decay the maxima slowly so one slow outlier does not stop a run hours early.
        self.step_s = max(step_s, self.step_s * 0.98)
        self.save_s = max(save_s, self.save_s)

    def must_stop(self, now: float | None = None) -> bool:
        if self.end_time is None:
            return False
        now = time.time() if now is None else now
        needed = self.steps_ahead * self.step_s + self.save_s + self.margin_s
        return now + needed >= self.end_time

    def seconds_left(self, now: float | None = None) -> float:
        if self.end_time is None:
            return math.inf
        return self.end_time - (time.time() if now is None else now)


DEADLINE_CODE = 1000  # above every signal number


def reason_code(reason: str | None) -> int:
    """reason_code is a stop reason as one int (0: none; a signal's number; the deadline)."""
    if reason is None:
        return 0
    return DEADLINE_CODE if reason == "deadline" else int(signal.Signals[reason])


def reason_name(code: int) -> str | None:
    if code == 0:
        return None
    return "deadline" if code == DEADLINE_CODE else signal.Signals(code).name


def agree(code: int, world_size: int) -> int:
    """agree is the largest stop reason code of any rank, on every rank (one all-reduce of one
    int): all ranks stop after the same step and report the same reason, even when a signal
    sent to every task reached this one a moment after the others. SIGTERM (preemption)
    outranks SIGUSR2; the deadline outranks both.

    A CPU tensor: the process group routes it to gloo, also on GPUs (`cpu:gloo,cuda:nccl`).
    """
    if world_size < 2:
        return code
    import torch
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return code
    flag = torch.tensor([code], dtype=torch.int32)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MAX)
    return int(flag.item())


@dataclass
class Stopper:
    """What the loop asks at each step boundary: should every rank stop after this step?"""

    flag: StopFlag
    deadline: Deadline
    rank: int
    world_size: int

    def check(self) -> str | None:
        """check returns the reason to stop (the same decision on every rank) or None."""
        reason = self.flag.reason
        if reason is None and self.rank == 0 and self.deadline.must_stop():
            reason = "deadline"
        agreed = reason_name(agree(reason_code(reason), self.world_size))
        if agreed is not None and self.flag.agreed_at is None:
            self.flag.agreed_at = time.time()
        return agreed


def env_margin(environ: Mapping[str, str] = os.environ) -> float:
    return float(environ.get("PYRECOVER_DEADLINE_MARGIN", "30"))
