"""The per-rank hang watchdog: a thread that notices a phase of the loop running far too long.

The loop reports each phase as it begins (`phase("forward", step)`) and each finished step
(`step_done()`). A daemon thread looks at the current phase a few times a second; once it has
run past its limit (`limit`, a pure function of the rule and what was seen so far), its
`on_hang` reports the hang and exits (hang_report.py). No collective is involved: the other
ranks may be exactly what is stuck.

Limits: a normal step's phases get `hang_timeout` seconds, or with `auto` a multiple of the
slowest step seen so far between a floor and a ceiling. The first step of a start (process
group warm-up, compilation), a checkpoint load and a checkpoint save get the larger startup
limit, and for loads, saves and the start-up before and after a load (`setup`: rank 0
checksums the survivors' snapshot there) it counts from the last sign of progress (this
process read or wrote bytes, `/proc/self/io`, or a checkpoint being written grew), so a long
save that keeps writing never fires, on the writing rank or on the ranks waiting for it. A
rank waiting for rank 0's checksum pass counts rank 0's beats as progress (checkpoint/resume.py;
train.py adds them).
torch's process group timeout is set above every limit (`backstop_seconds`): the watchdog
always speaks first, torch's timeout stays the backstop.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pyrecover")

# `auto`: a phase may take this many times the slowest step seen, within [floor, ceiling].
AUTO_FACTOR = 10.0
AUTO_FLOOR_S = 60.0
AUTO_CEILING_S = 600.0
BACKSTOP_MARGIN_S = 60.0  # torch's timeout fires this long after the largest watchdog limit
SLOW_IO_BYTES_PER_S = 100e6  # a shared file system under load, per client: one pass over it
# Phases whose clock restarts at each sign of progress and whose limit is the startup one.
IO_PHASES = ("setup", "load", "checkpoint")
# Phases that never wait on another rank: their time is this rank's own compute time.
OWN_PHASES = ("data", "forward")
STEP_START = "data"  # the first phase of every step


@dataclass(frozen=True)
class Rule:
    """When a phase counts as hung. `fixed` seconds, or None for the adaptive rule."""

    fixed: float | None = None
    startup: float = 900.0
    factor: float = AUTO_FACTOR
    floor: float = AUTO_FLOOR_S
    ceiling: float = AUTO_CEILING_S
    enabled: bool = True


def rule_from(hang_timeout: str, startup_timeout: float) -> Rule:
    """rule_from reads `run.hang_timeout` (`auto`, `off` or seconds; config.py validated it)."""
    text = str(hang_timeout).strip().lower()
    if text == "off":
        return Rule(startup=startup_timeout, enabled=False)
    return Rule(fixed=None if text == "auto" else float(text), startup=startup_timeout)


def limit(rule: Rule, phase: str, steps_done: int, slowest_step: float) -> float:
    """limit is how long `phase` may run (setup, loads, saves: without progress) before it is a
    hang.

    `steps_done` counts the steps finished since this process started, `slowest_step` is the
    longest of them (seconds). The first step, loads and saves get the startup limit.
    """
    if steps_done == 0 or phase in IO_PHASES:
        return rule.startup
    if rule.fixed is not None:
        return rule.fixed
    return min(rule.ceiling, max(rule.floor, rule.factor * slowest_step))


def backstop_seconds(rule: Rule, state_bytes: int = 0) -> float:
    """backstop_seconds is torch's process group timeout: above every limit the rule can give
    and one pass over a checkpoint of `state_bytes` on slow storage (the ranks waiting for rank
    0's checksum pass or save wait inside a collective, which torch ends at this timeout)."""
    step = rule.fixed if rule.fixed is not None else rule.ceiling
    return max(step, rule.startup) + BACKSTOP_MARGIN_S + state_bytes / SLOW_IO_BYTES_PER_S


def saving_bytes(root: Path) -> int:
    """saving_bytes is the size of the files in checkpoints being written under `root` (its
    `.tmp-step-*` and `.snap-step-*` folders): a rank waiting for a peer's write sees the
    save progress there."""
    total = 0
    try:
        with os.scandir(root) as entries:
            folders = [e.path for e in entries if e.name.startswith((".tmp-step-", ".snap-step-"))]
        for folder in folders:
            with os.scandir(folder) as files:
                total += sum(f.stat().st_size for f in files if f.is_file())
    except OSError:  # a folder renamed or removed while looked at: progress too
        return -1
    return total


_self_read = 0  # bytes io_bytes itself read from /proc/self/io (they count in rchar too)


def io_bytes() -> int:
    """io_bytes is the bytes this process read and wrote so far, less the reads of this
    function itself (0 where /proc has no io)."""
    global _self_read
    try:
        fd = os.open("/proc/self/io", os.O_RDONLY)
        try:
            data = os.read(fd, 4096)  # one read: rchar grows by exactly len(data)
        finally:
            os.close(fd)
    except OSError:
        return 0
    # The text was made before this read was counted: only the earlier ones are in it.
    earlier, _self_read = _self_read, _self_read + len(data)
    fields = dict(line.split(b":", 1) for line in data.splitlines() if b":" in line)
    try:
        return int(fields[b"rchar"]) + int(fields[b"wchar"]) - earlier
    except (KeyError, ValueError):
        return 0


@dataclass
class Hang:
    """What the watchdog saw when it fired."""

    rank: int
    node: str
    phase: str
    step: int
    seconds: float
    """How long the phase had run (setup, loads, saves: since their last progress)."""
    limit: float


@dataclass
class Watchdog:
    """Phase tracking for one rank, and the thread that fires on a hang.

    Unstarted, it only keeps time: `phase` and `step_done` cost a few attribute writes.
    """

    rule: Rule = field(default_factory=lambda: Rule(enabled=False))
    rank: int = 0
    node: str = ""
    on_hang: Callable[[Hang], None] | None = None
    clock: Callable[[], float] = time.monotonic
    progress: Callable[[], int] = io_bytes
    poll_s: float = 0.25

    def __post_init__(self) -> None:
        now = self.clock()
        self._current = ("setup", 0, now)  # phase, step, started; replaced as one tuple
        self._step_started = now
        self._own = 0.0
        self._seen = (-1.0, 0, now)  # (the phase's start, progress count, when it last moved)
        self.steps_done = 0
        self.slowest_step = 0.0
        self.fired = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --- called by the loop (main thread) -------------------------------------------------

    def phase(self, name: str, step: int | None = None) -> None:
        """phase marks the start of `name` (and the end of the phase before it). `data`, the
        first phase of a step, also starts the step's clock."""
        now = self.clock()
        prev, prev_step, started = self._current
        if prev in OWN_PHASES:
            self._own += now - started
        if name == STEP_START:
            self._step_started, self._own = now, 0.0
        self._current = (name, prev_step if step is None else step, now)

    def step_done(self) -> tuple[float, float]:
        """step_done ends a step; returns its seconds and this rank's own compute seconds."""
        now = self.clock()
        self.phase("boundary")
        seconds, own = now - self._step_started, self._own
        # The first step of a start holds warm-up and compilation: it sets no limit.
        if self.steps_done > 0:
            self.slowest_step = max(self.slowest_step, seconds)
        self.steps_done += 1
        self._step_started, self._own = now, 0.0
        return seconds, own

    @property
    def step(self) -> int:
        return self._current[1]

    @property
    def current(self) -> str:
        """The phase that runs now."""
        return self._current[0]

    # --- the thread -----------------------------------------------------------------------

    def check(self) -> Hang | None:
        """check returns a Hang when the current phase is past its limit (the thread's test)."""
        if not self.rule.enabled:
            return None
        now = self.clock()
        name, step, started = self._current
        if name == "idle":
            return None
        since = started
        if name in IO_PHASES:
            count = self.progress()
            phase_of, seen, moved = self._seen
            if phase_of != started:  # the first look at this phase: its baseline
                self._seen = (started, count, started)
            elif count != seen:
                self._seen = (started, count, now)
            since = self._seen[2]
        allowed = limit(self.rule, name, self.steps_done, self.slowest_step)
        if now - since <= allowed:
            return None
        return Hang(self.rank, self.node, name, step, round(now - since, 3), allowed)

    def start(self) -> Watchdog:
        if self.rule.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="pyrecover-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """stop ends the thread; if it is reporting a hang, the process exits meanwhile."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            hang = self.check()
            if hang is not None:
                self.fired.set()
                if self.on_hang is not None:
                    self.on_hang(hang)
                return
