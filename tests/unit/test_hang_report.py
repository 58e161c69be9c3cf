"""What a rank does once its watchdog fired: report, persist and exit, whatever of it is stuck.

The stuck store is a real TCPStore whose host process is stopped (SIGSTOP), as rank 0's is
when the kernel or a user stops it: its peers' store calls then block for good.
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import subprocess
import sys
import threading

import pytest

from pyrecover import hang_report, heartbeat, watchdog

STORE_HOST = ("from torch.distributed import TCPStore; import time; "
              "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False); "
              "print(s.port, flush=True); time.sleep(600)")


class Exits:
    """Records the exit code handle asks for, in place of os._exit."""

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.called = threading.Event()

    def __call__(self, code: int) -> None:
        self.codes.append(code)
        self.called.set()


def _hang(rank: int = 1) -> watchdog.Hang:
    return watchdog.Hang(rank=rank, node=f"n{rank}", phase="allreduce", step=9, seconds=6.0,
                         limit=5.0)


@pytest.fixture(autouse=True)
def _fresh_persist():
    hang_report._persisted = False
    yield
    hang_report._persisted = False


def test_handle_dumps_every_thread_records_the_event_persists_and_exits_with_its_code(caplog):
    events, persisted, exits = [], [], []
    stuck = threading.Event()
    t = threading.Thread(target=stuck.wait, name="stuck-worker", daemon=True)
    t.start()
    hang = watchdog.Hang(rank=1, node="n1", phase="allreduce", step=9, seconds=6.0, limit=5.0)
    hang_report.handle(hang, lambda kind, **f: events.append((kind, f)),
                       lambda: persisted.append(1), exit=exits.append)
    stuck.set()
    (kind, fields), = events
    assert kind == "hang"
    assert (fields["rank"], fields["node"], fields["phase"], fields["step"]) == (1, "n1",
                                                                                 "allreduce", 9)
    assert "thread stuck-worker:" in fields["stacks"] and "waiter.acquire()" in fields["stacks"]
    assert persisted == [1] and exits == [76]
    assert "HANG on rank 1" in caplog.text


def test_handle_exits_with_its_code_at_its_deadline_when_the_persist_never_returns():
    # The persist stands in for one stuck for good: on CUDA a snapshot copy queued behind the
    # collective a dead peer never finishes, or the main thread holding the persist lock in it.
    stuck, exited, exits = threading.Event(), threading.Event(), []
    hang = watchdog.Hang(rank=0, node="n0", phase="allreduce", step=3, seconds=6.0, limit=5.0)

    def exit(code: int) -> None:
        exits.append(code)
        exited.set()

    handler = threading.Thread(target=hang_report.handle, daemon=True, kwargs=dict(
        hang=hang, event=lambda kind, **f: None, persist=stuck.wait, exit=exit, deadline_s=0.5))
    handler.start()
    try:
        assert exited.wait(60), "the watchdog never exited while its persist was stuck"
    finally:
        stuck.set()
    handler.join(60)
    assert exits == [76]  # once, even though the persist returned later


def test_handle_never_cuts_off_a_persist_that_keeps_making_progress(caplog):
    # The persist stands in for a large memory-mode snapshot written after a hang: it takes
    # several deadlines, and the bytes it writes (here: a counter) move all the while.
    calls, finished, exits = threading.Semaphore(0), [], []
    moved = itertools.count()
    hang = watchdog.Hang(rank=0, node="n0", phase="allreduce", step=3, seconds=6.0, limit=5.0)

    def progress() -> int:
        calls.release()
        return next(moved)

    def persist() -> None:
        for _ in range(4):  # the deadline's first look, then three deadlines later
            assert calls.acquire(timeout=60)
        finished.append(True)

    hang_report.handle(hang, event=lambda kind, **f: None, persist=persist, deadline_s=0.05,
                       exit=lambda code: exits.append((code, bool(finished))), progress=progress)
    assert exits == [(76, True)]
    assert "made no progress" not in caplog.text


def test_a_rank_whose_heartbeat_store_host_is_stopped_still_reports_its_hang_and_exits(caplog):
    # Rank 0 hosts the store (srun, train --nproc); stopped, it never answers rank 1's reads,
    # and rank 1 used to wait there for as long as rank 0 stayed stopped: no report, no exit.
    host = subprocess.Popen([sys.executable, "-c", STORE_HOST], stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(host.stdout.readline())
        store = heartbeat.connect("127.0.0.1", port)
        assert store is not None
        beats = heartbeat.Heartbeat(store, 1, 2, "n1").start()
        os.kill(host.pid, signal.SIGSTOP)
        events, exits = [], Exits()
        handler = threading.Thread(target=hang_report.handle, daemon=True, kwargs=dict(
            hang=_hang(), event=lambda kind, **f: events.append((kind, f)),
            persist=lambda: None, exit=exits, silent=beats.silent,
            leaving=functools.partial(beats.stop, wait=False), silent_wait_s=1.0,
            leaving_wait_s=1.0))
        handler.start()
        assert exits.called.wait(120), "the hang was never reported: the store call blocked"
        assert exits.codes == [76]
        [(kind, fields)] = events
        assert kind == "hang" and "silent_ranks" not in fields  # no one is named
        assert "the heartbeat store did not answer" in caplog.text
    finally:
        host.kill()  # a stopped process dies of SIGKILL too
        host.wait()


def test_a_report_that_never_ends_is_cut_off_at_the_deadline_though_bytes_move(caplog):
    # The report's own reads (the stacks' source lines) and log lines move the progress
    # count; they bought every stuck report a second deadline. A report stuck past the
    # deadline (here the question to the store) now ends the process at the first.
    stuck, exits = threading.Event(), Exits()
    moving = itertools.count()
    handler = threading.Thread(target=hang_report.handle, daemon=True, kwargs=dict(
        hang=_hang(0), event=lambda kind, **f: None, persist=lambda: None, exit=exits,
        silent=lambda: stuck.wait() and None, silent_wait_s=600.0, deadline_s=0.2,
        progress=lambda: next(moving)))
    handler.start()
    try:
        assert exits.called.wait(120), "the deadline waited on a report that never ended"
    finally:
        stuck.set()
    handler.join(60)
    assert exits.codes == [76]
    assert "reporting the hang made no progress" in caplog.text


def test_a_store_that_did_not_answer_is_not_reported_as_no_peer_went_silent(caplog):
    """The log said 'the heartbeat store did not answer; no silent rank named' and then, in
    the HANG line itself, 'no peer went silent': a claim nobody could check."""
    for silent, said in ((lambda: None, "silent peers unknown"),
                         (lambda: heartbeat.Silence([], []), "no peer went silent")):
        caplog.clear()
        hang_report._persisted = False
        hang_report.handle(_hang(), event=lambda kind, **f: None, persist=lambda: None,
                           exit=lambda code: None, silent=silent)
        line = next(r.getMessage() for r in caplog.records if "HANG on rank" in r.getMessage())
        assert said in line.splitlines()[0]
    stuck = threading.Event()
    caplog.clear()
    hang_report._persisted = False
    hang_report.handle(_hang(), event=lambda kind, **f: None, persist=lambda: None,
                       exit=lambda code: None, silent=lambda: stuck.wait() and None,
                       silent_wait_s=0.05)
    stuck.set()
    line = next(r.getMessage() for r in caplog.records if "HANG on rank" in r.getMessage())
    assert "silent peers unknown" in line.splitlines()[0]


def test_a_rank_that_was_itself_stopped_names_no_silent_peer(caplog):
    """train --nproc 2, rank 0 (the store's host) SIGSTOPped in step 8: rank 1 reported and
    left, unable to tell the stopped store it left; rank 0, continued 47 s past its limit,
    named rank 1 silent and its node the suspect, which a job excludes: the healthy one. A
    watchdog that fires that late was frozen itself; the peers' silence proves nothing."""
    events, asked = [], []
    late = watchdog.Hang(rank=0, node="n0", phase="forward", step=8, seconds=52.2, limit=5.0)

    def silent():
        asked.append(1)
        return heartbeat.Silence([1], ["n1"])

    hang_report.handle(late, event=lambda kind, **f: events.append(f), persist=lambda: None,
                       exit=lambda code: None, silent=silent)
    [fields] = events
    assert "silent_ranks" not in fields and "suspect_node" not in fields and not asked
    assert "fired 47s late" in caplog.text
    assert "silent peers unknown (this process was stopped or frozen)" in caplog.text
    events.clear()
    hang_report._persisted = False
    hang_report.handle(_hang(), event=lambda kind, **f: events.append(f), persist=lambda: None,
                       exit=lambda code: None, silent=silent)  # on time: named as before
    assert events[0]["suspect_node"] == "n1"
