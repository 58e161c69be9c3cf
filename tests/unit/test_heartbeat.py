"""Heartbeats in a real TCP store (the kind the process group's rendezvous runs): a rank whose
beats stop is named silent with its node; a rank that exited is not."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from torch.distributed import TCPStore

from pyrecover import heartbeat
from pyrecover.spawn import free_port


def test_a_rank_whose_heartbeat_stops_is_named_silent_and_one_that_exited_is_not():
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    nodes = ["nodeA", "nodeB", "nodeC", "nodeB"]
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 4, node,
                                 every_s=0.05).start() for rank, node in enumerate(nodes)]
    beats[1]._stop.set()  # as a SIGSTOP would: the thread stops, no `exit` is written
    beats[1]._thread.join()
    beats[2].stop()  # left the job after, say, reporting the hang itself

    found = beats[0].silent()
    assert found == heartbeat.Silence([1], ["nodeB"]) and found.node == "nodeB"
    beats[3]._stop.set()
    beats[3]._thread.join()
    both = beats[0].silent()
    assert both.ranks == [1, 3] and both.node == "nodeB"  # both silent ranks on one node
    beats[1].stop()  # they exit after all: each writes `exit`
    beats[3].stop()
    assert beats[0].silent() == heartbeat.Silence([], [])  # (its own beats still count)
    beats[0].stop()
    del server


def test_silent_ranks_on_two_nodes_name_no_single_node():
    assert heartbeat.Silence([1, 5], ["n1", "n2"]).node is None
    assert heartbeat.Silence([], []).node is None


def test_no_store_means_no_heartbeat_and_no_error():
    port = free_port()  # nobody listens there
    done = threading.Event()
    result: list = []

    def call() -> None:
        result.append(heartbeat.start("127.0.0.1", port, 1, 2, "n1"))
        done.set()

    threading.Thread(target=call, daemon=True).start()
    assert done.wait(60) and result == [None]


class BlipStore:
    """Stands in for a moment of the management network's trouble: the real store's client,
    whose next `set` calls (as many as `blips` holds) time out as TCPStore's do."""

    def __init__(self, store) -> None:
        self.store, self.blips = store, 0

    def set(self, key, value) -> None:
        if self.blips:
            self.blips -= 1
            raise RuntimeError("Socket Timeout")
        self.store.set(key, value)

    def get(self, key):
        return self.store.get(key)


def test_a_rank_whose_store_blipped_beats_on_and_is_not_named_silent_later():
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    flaky = BlipStore(heartbeat.connect("127.0.0.1", port))
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), 0, 2, "nodeA",
                                 every_s=0.05).start(),
             heartbeat.Heartbeat(flaky, 1, 2, "nodeB", every_s=0.05).start()]
    flaky.blips = heartbeat.GIVE_UP_FAILURES - 1  # fewer than a store that is gone
    deadline = time.monotonic() + 30
    while flaky.blips and time.monotonic() < deadline:  # its thread tries a beat after each
        time.sleep(0.01)
    assert flaky.blips == 0  # it did not give up at the first
    assert beats[0].silent() == heartbeat.Silence([], [])  # rank 1 beats on after the blips
    flaky.blips = heartbeat.GIVE_UP_FAILURES  # its host left: rank 1's beats end
    beats[1]._thread.join(timeout=30)
    assert not beats[1]._thread.is_alive()
    for beat in beats:
        beat.stop()
    del server


def test_rank_0_which_holds_the_store_leaves_after_the_others_have_said_exit(monkeypatch):
    """Rank 0 leaving first cut off the others' `exit` writes (a C++ warning each, under a
    start error's one line); it waits for them, and not for ever for one that never writes."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 3, "n",
                                 every_s=0.05).start() for rank in range(3)]
    monkeypatch.setattr(heartbeat, "LEAVE_WAIT_S", 120.0)  # far past any busy machine's lag
    rank0_done = threading.Event()
    leaving = threading.Thread(target=lambda: (beats[0].stop(), rank0_done.set()))
    leaving.start()
    beats[1].stop()
    assert not rank0_done.wait(0.3)  # rank 2 has not said it leaves
    beats[2].stop()
    assert rank0_done.wait(10)
    leaving.join()
    # A rank that died never writes `exit`: rank 0 still leaves, after LEAVE_WAIT_S at most.
    alone = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 2, "n",
                                 every_s=0.05).start() for rank in range(2)]
    alone[1]._stop.set()  # as a crash would: no `exit`
    alone[1]._thread.join()
    alone[1].store.set(heartbeat.key(1), "7")
    monkeypatch.setattr(heartbeat, "LEAVE_WAIT_S", 0.2)
    began = time.monotonic()
    alone[0].stop()  # returns, the bound reached
    assert 0.2 <= time.monotonic() - began < 60
    alone[0].stop()  # a second call does nothing: no second wait
    del server



def test_rank_0_does_not_wait_for_a_peer_that_died_but_waits_for_one_that_beats(monkeypatch):
    """After a crash (a peer SIGKILLed: no `exit` ever), rank 0 left only after LEAVE_WAIT_S,
    3 s of every crash's restart (`bench restart --local --interrupt crash`: "kill ->
    survivors exit 3.12"), and under SLURM's KillWait on a busy node it was killed before it
    recorded its exit. A peer whose counter stands still is not waited for; one whose
    heartbeat still beats (it is leaving too) is."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    monkeypatch.setattr(heartbeat, "LEAVE_WAIT_S", 120.0)  # far past any busy machine's lag
    monkeypatch.setattr(heartbeat, "DEAD_S", 0.5)
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 3, "n",
                                 every_s=0.05).start() for rank in range(3)]
    beats[2]._stop.set()  # rank 2 dies: its counter stands still, and it never says `exit`
    beats[2]._thread.join()
    done = threading.Event()
    leaving = threading.Thread(target=lambda: (beats[0].stop(), done.set()))
    leaving.start()
    assert not done.wait(1.5)  # rank 1 beats on: it is waited for, rank 2 or not
    beats[1].stop()
    assert done.wait(60)  # not LEAVE_WAIT_S: rank 2 is not waited for
    leaving.join()
    del server


class LookedStore:
    """The real store's client, which says (`looked`) when rank 0 first looked for a peer."""

    def __init__(self, store) -> None:
        self.store, self.looked = store, threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def check(self, keys: list[str]) -> bool:
        found = self.store.check(keys)
        self.looked.set()
        return found


def test_rank_0_waits_for_a_peer_that_has_not_beaten_yet(monkeypatch):
    """Rank 0 may fail the moment its heartbeat starts, before a peer has started its own: it
    waits for that peer's `exit` as well, instead of taking the missing key for a rank gone."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    monkeypatch.setattr(heartbeat, "LEAVE_WAIT_S", 120.0)  # far past any busy machine's lag
    store = LookedStore(heartbeat.connect("127.0.0.1", port))
    first = heartbeat.Heartbeat(store, 0, 2, "n", every_s=0.05).start()
    late = heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), 1, 2, "n", every_s=0.05)
    first.stop(wait=False)  # as the trainer leaves: `exit`, then the wait
    seen: list[bool] = []

    def wait() -> None:
        first.wait_for_the_others()
        seen.append(late.store.check([heartbeat.key(1)]))  # rank 1 had said `exit` by then

    waiting = threading.Thread(target=wait)
    waiting.start()
    assert store.looked.wait(60)  # rank 0 found no key for rank 1 ...
    late.start()  # ... which begins only now ...
    late.stop()  # ... and leaves (its next collective failed: rank 0 is gone)
    waiting.join(60)
    assert not waiting.is_alive() and seen == [True]
    assert bytes(late.store.get(heartbeat.key(1))) == heartbeat.EXITED
    del server


def test_a_peer_freed_by_a_rank_that_stopped_on_an_error_names_it_and_does_not_say_died():
    from pyrecover import peers

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 3, "n")
             for rank in range(3)]
    reset = RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    assert peers.peer_lost(reset)
    died = peers.lost(0, reset, beats[0])  # nobody said anything: a peer died
    assert isinstance(died, peers.PeerLost) and "another rank of the job died" in str(died)
    beats[2].say_error("PermissionError: [Errno 13] Permission denied: 'events.jsonl'")
    named = peers.lost(0, reset, beats[0])
    assert isinstance(named, peers.PeerStopped) and isinstance(named, peers.PeerLost)  # exit 1
    assert str(named) == "rank 0: stopped because rank 2 stopped on an error (its own line " \
        "says which)"
    assert (named.rank, named.reason) == (2, "PermissionError: [Errno 13] Permission denied: "
                                             "'events.jsonl'")  # what rank 0 records
    assert isinstance(peers.lost(2, reset, beats[2]), peers.PeerLost)  # not itself
    assert isinstance(peers.lost(1, reset, None), peers.PeerLost)  # no heartbeat: no name
    del server


def test_rank_0_waits_longer_once_a_rank_said_its_error_and_not_for_a_peer_that_never_beat(
        monkeypatch):
    """A peer not in a collective yet when a rank stops on an error reads that error only
    while rank 0 serves the store: rank 0 waits LEAVE_AFTER_ERROR_WAIT_S for it, not
    LEAVE_WAIT_S. A peer that never started a heartbeat is not waited for past START_S."""
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    monkeypatch.setattr(heartbeat, "LEAVE_WAIT_S", 0.0)
    monkeypatch.setattr(heartbeat, "LEAVE_AFTER_ERROR_WAIT_S", 120.0)
    beats = [heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), rank, 2, "n",
                                 every_s=0.05).start() for rank in range(2)]
    beats[0].say_error("ConfigError: bad")
    done = threading.Event()
    leaving = threading.Thread(target=lambda: (beats[0].stop(), done.set()))
    leaving.start()
    assert not done.wait(0.5)  # LEAVE_WAIT_S is past: it waits for rank 1 all the same
    beats[1].stop()
    assert done.wait(60)
    leaving.join()

    other = TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=10))
    monkeypatch.setattr(heartbeat, "LEAVE_WAIT_S", 120.0)
    monkeypatch.setattr(heartbeat, "START_S", 0.0)  # rank 1's heartbeat never came
    alone = heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", other.port), 0, 2, "n",
                                every_s=0.05).start()
    began = time.monotonic()
    alone.stop()
    assert time.monotonic() - began < 60  # not LEAVE_WAIT_S
    del server, other


def test_a_restarted_attempt_reads_neither_the_last_attempts_error_nor_its_exits():
    """Under `torchrun --max-restarts` the agent's store outlives its workers. Attempt 1 must
    not take attempt 0's `error` for a rank of its own that stopped (rank 0 would wait
    LEAVE_AFTER_ERROR_WAIT_S, peers would blame a rank that is fine), nor a peer that has not
    beaten yet for one that exited."""
    from pyrecover import peers

    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10),
                      wait_for_workers=False)
    old = [heartbeat.start("127.0.0.1", port, rank, 2, "n", attempt=0) for rank in range(2)]
    old[1].say_error("ConfigError: bad")
    old[1].stop()
    assert old[0].stopped_on_error() == (1, "ConfigError: bad")

    new = heartbeat.start("127.0.0.1", port, 0, 2, "n", attempt=1)
    assert new.stopped_on_error() is None
    reset = RuntimeError("[pair.cc:537] Read error: Connection reset by peer")
    assert type(peers.lost(0, reset, new)) is peers.PeerLost  # not "rank 1 stopped"
    assert new._read([1], absent=b"") == {1: b""}  # rank 1 of attempt 1 has not beaten yet
    for beats in (*old, new):
        beats.stop(wait=False)
    del server


SERVER = """
import time
from datetime import timedelta
from torch.distributed import TCPStore
store = TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=30), wait_for_workers=False)
print(store.port, flush=True)
time.sleep(600)
"""


def test_a_store_whose_host_left_costs_one_cpp_trace_per_rank_not_one_per_use(capfd):
    """Rank 0's process holds the store; once it has left (a hang report, an error), each
    use of the store by a peer (a beat, the hang report's look for silent ranks, its `exit`,
    its error) printed torch's 20-line C++ trace of the broken pipe: under `train --nproc N`
    a hang flooded the log with them. The first failure that says the connection is closed
    is the last use."""
    import subprocess
    import sys

    server = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        beat = heartbeat.Heartbeat(heartbeat.connect("127.0.0.1", port), 1, 2, "node",
                                   every_s=0.05).start()
    finally:
        server.kill()
        server.wait()
    beat._thread.join(timeout=60)  # its beats end once the store is gone
    assert not beat._thread.is_alive()
    assert beat.silent() is None  # nothing named, as before
    beat.say_error("DataError: x")
    assert beat.stopped_on_error() is None
    beat.stop()
    assert capfd.readouterr().err.count("TCPStore.cpp") <= 1
