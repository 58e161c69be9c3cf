"""What a rank does once its watchdog fired (watchdog.py): it dumps every thread's Python
stack into its log, asks whether the CUDA device still answers and which peers went silent
(heartbeat.py), records a `hang` event, tells its peers it leaves, lets memory mode persist
its complete snapshots as the survivors of a crash do, and exits with `EXIT_HANG`.

It runs in the watchdog's thread while the main thread is stuck, and anything it calls may be
stuck as well. Each of its waits is bounded:
- the CUDA probe (`cuda_answer`) and the question to the heartbeat store (`SILENT_WAIT_S`),
  and the peers told it leaves (`LEAVING_WAIT_S`), in threads of their own: a call into the
  store blocks for good where the store's host (rank 0, or torchrun's agent) is stopped
  (TCPStore's timeout covers a wait for a key, not a server that never answers), and rank 1
  waited there for as long as rank 0 stayed stopped;
- the whole report within `deadline_s` (HANDLE_DEADLINE_S), progress or not: its own reads
  of the source files for the stacks and its log lines are no sign that a persist moves
  (counted as such, they bought every hang a second deadline);
- after the report, the persist for as long as it keeps reading or writing (`progress`), and
  `deadline_s` more when it stops: a large snapshot that keeps writing is never cut off.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from pyrecover.watchdog import Hang

log = logging.getLogger("pyrecover")

STACK_CHARS = 12_000  # of all stacks together, in the event (the log gets them whole)
# handle exits this long after a hang at the latest, persisted or not: a survivor writes two
# snapshots of its slices (minutes only for a state of terabytes on slow storage).
HANDLE_DEADLINE_S = 300.0
# heartbeat.Heartbeat.silent waits 30 s at most for its window, and a store read takes up
# to its 5 s timeout: past this the store is taken as not answering.
SILENT_WAIT_S = 35.0
LATE_S = 10.0  # a watchdog firing later than this (or its limit) after its limit was frozen
LEAVING_WAIT_S = 10.0  # Heartbeat.stop: its thread's join (6 s at most) and one write


def stacks(skip_current: bool = True) -> list[str]:
    """stacks formats every thread's Python stack, the main thread first."""
    names = {t.ident: t.name for t in threading.enumerate()}
    main = threading.main_thread().ident
    out = []
    for ident, frame in sorted(sys._current_frames().items(), key=lambda kv: kv[0] != main):
        if skip_current and ident == threading.get_ident():
            continue
        text = "".join(traceback.format_stack(frame))
        out.append(f"thread {names.get(ident, ident)!s}:\n{text}")
    return out


def bounded(fn: Callable[[], Any], wait_s: float, name: str) -> tuple[bool, Any]:
    """bounded runs `fn` in a daemon thread called `name` and waits `wait_s` for it: (whether
    it returned, its value). An exception it raises comes out here; one that does not return
    is left behind (the process is about to exit)."""
    done, box = threading.Event(), []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as exc:  # raised in the caller's thread, below
            box.append((False, exc))
        done.set()

    threading.Thread(target=run, name=name, daemon=True).start()
    if not done.wait(wait_s):
        return False, None
    ok, value = box[0]
    if not ok:
        raise value
    return True, value


def cuda_answer(device, wait_s: float = 5.0) -> str:
    """cuda_answer says whether the CUDA device finishes its queued work within `wait_s`."""
    import torch

    if device is None or getattr(device, "type", "cpu") != "cuda":
        return "n/a (CPU)"
    started = time.monotonic()
    if bounded(lambda: torch.cuda.synchronize(device), wait_s, "pyrecover-cuda-probe")[0]:
        return f"answered in {time.monotonic() - started:.2f}s"
    return (f"no answer in {wait_s:.0f}s: a kernel or collective queued on it has not "
            "finished")


_persist_lock = threading.Lock()
_persisted = False


def persist_once(persist: Callable[[], None]) -> None:
    """persist_once runs the survivors' persist once per process, whichever thread is first
    (the watchdog on a hang, the main thread on a failed collective); a second caller waits
    for the first to finish and then returns."""
    global _persisted
    with _persist_lock:
        if _persisted:
            return
        _persisted = True
        persist()


def handle(hang: Hang, event: Callable[..., object], persist: Callable[[], None],
           device=None, exit_code: int | None = None,
           exit: Callable[[int], object] = os._exit, silent: Callable[[], Any] | None = None,
           leaving: Callable[[], None] | None = None,
           deadline_s: float = HANDLE_DEADLINE_S,
           progress: Callable[[], int] | None = None,
           silent_wait_s: float = SILENT_WAIT_S,
           leaving_wait_s: float = LEAVING_WAIT_S) -> None:
    """handle reports a hang (log with every stack, `hang` event), persists, and exits.

    `event(kind, **fields)` records into events.jsonl; `persist()` saves what memory mode
    holds; `silent()` names the peers whose heartbeat stopped (heartbeat.py: a stopped rank
    cannot report itself), and `leaving()` tells the peers this rank is exiting. Whatever of
    this is stuck too, the process exits with the same code in the bounds the module
    docstring gives: `progress` is a number that grows while work gets done (the bytes this
    process read and wrote).
    """
    from pyrecover.preempt import EXIT_HANG

    code = EXIT_HANG if exit_code is None else exit_code
    exit_once = _once(exit)
    reported, done = threading.Event(), threading.Event()
    threading.Thread(target=_deadline, name="pyrecover-hang-deadline", daemon=True,
                     args=(hang, deadline_s, code, exit_once, progress, reported, done)).start()
    dumped = stacks()
    cuda = cuda_answer(device)
    quiet, unknown = None, ""
    late = hang.seconds - hang.limit
    if silent is not None and late > max(LATE_S, hang.limit):
        # The watchdog looks 4 times a second: this process was stopped or frozen itself,
        # and a peer that left meanwhile (unable to tell the store, which may be ours) would
        # look silent. Its node is no suspect.
        log.warning("rank %d: its watchdog fired %.0fs late: this process was itself stopped "
                    "or frozen; no silent rank named", hang.rank, late)
        unknown = "silent peers unknown (this process was stopped or frozen)"
    elif silent is not None:
        answered, quiet = bounded(silent, silent_wait_s, "pyrecover-hang-silent")
        if not answered:
            log.warning("rank %d: the heartbeat store did not answer in %.0fs (its host is "
                        "stopped or gone); no silent rank named", hang.rank, silent_wait_s)
        unknown = "silent peers unknown (the heartbeat store did not answer)"
    named: dict[str, Any] = {}
    if quiet is not None and quiet.ranks:
        named = {"silent_ranks": quiet.ranks, "silent_nodes": quiet.nodes}
        if quiet.node is not None:
            named["suspect_node"] = quiet.node
    log.error("HANG on rank %d (%s): phase %r of step %d has run %.1fs, over its %.1fs limit; "
              "CUDA %s; %s. Stacks of every thread:\n%s", hang.rank, hang.node, hang.phase,
              hang.step, hang.seconds, hang.limit, cuda,
              f"silent ranks {quiet.ranks} on {quiet.nodes}" if named else
              unknown if silent is not None and quiet is None else "no peer went silent",
              "\n".join(dumped))
    text = "\n".join(dumped)
    try:
        event("hang", rank=hang.rank, node=hang.node, phase=hang.phase, step=hang.step,
              seconds=hang.seconds, limit=hang.limit, cuda=cuda, **named,
              stacks=text[:STACK_CHARS])
    except OSError as exc:
        log.error("could not record the hang event: %s", exc)
    if leaving is not None:
        try:
            if not bounded(leaving, leaving_wait_s, "pyrecover-hang-leaving")[0]:
                log.debug("rank %d: its peers were not told it leaves in %.0fs", hang.rank,
                          leaving_wait_s)
        except Exception as exc:
            log.debug("rank %d: could not say it is leaving: %s", hang.rank, exc)
    reported.set()
    try:
        persist_once(persist)
    except Exception as exc:  # exiting matters more than this
        log.error("rank %d could not persist after the hang: %s", hang.rank, exc)
    done.set()
    _flush()
    exit_once(code)


def _once(exit: Callable[[int], object]) -> Callable[[int], None]:
    """_once calls `exit` the first time only (the deadline's thread or handle's own end)."""
    lock, called = threading.Lock(), []

    def once(code: int) -> None:
        with lock:
            if called:
                return
            called.append(code)
        exit(code)
    return once


def _deadline(hang: Hang, deadline_s: float, code: int, exit: Callable[[int], None],
              progress: Callable[[], int] | None, reported: threading.Event,
              done: threading.Event) -> None:
    """_deadline exits with `code` where the report is not done within `deadline_s`, or once
    `deadline_s` passed after it without `progress` moving, unless `done` (handle ended by
    itself) is set first."""
    if reported.wait(deadline_s):
        mark = progress() if progress is not None else None
        while not done.wait(deadline_s):
            now = progress() if progress is not None else None
            if now is None or now == mark:
                break
            mark = now
        else:
            return
        what = "persisting"
    else:
        what = "reporting"
    log.error("rank %d: %s the hang made no progress for %.0fs; exiting with %d without "
              "it", hang.rank, what, deadline_s, code)
    _flush()
    exit(code)


def _flush() -> None:
    for h in log.handlers:
        h.flush()
    sys.stderr.flush()
