"""Heartbeats: each rank's sign of life in the process group's key-value store, so that the
ranks that find a job hung can name the rank that stopped living.

A rank that hangs inside its own work reports itself (watchdog.py, hang_report.py). A rank
that stops altogether (SIGSTOP, a node that freezes, a thread holding the GIL for good)
cannot: its peers only see their collective never finish, which blames no one. So a thread on every
rank bumps a counter under `beat/<rank>` in the TCP store that the process group's
rendezvous already runs (`MASTER_ADDR:MASTER_PORT`, a second client connection) every
`BEAT_S`; a stopped process's thread stops with it. When a rank's watchdog fires, `silent`
reads every counter twice, `WINDOW_BEATS` of its own beats apart (2 s): the ranks whose
counter did not move are silent.
Counters rather than times, so clocks that differ between nodes do not matter. A rank that
exits (a hang report, an error) first writes `exit`, so a peer that checks after it left
does not take it for silent. Where the store does not answer (its host, rank 0 or the
torchrun agent, is itself stopped or gone) nothing is named.
A rank that stops on a user error (a run directory it may not read, a tracker that does not
start) says so under `error` before it leaves, so that the peers its leaving frees
say that rank stopped, not that it died (train.py).
Every key lies under `pyrecover/attempt_<n>/`, n being torchrun's restart count where the
store is torchrun's agent's (`DistEnv.store_attempt`, 0 elsewhere): under `torchrun
--max-restarts` that store outlives its workers, and an attempt must not read the last one's
`exit` or `error`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

log = logging.getLogger("pyrecover")

BEAT_S = 0.5
WINDOW_BEATS = 4  # a peer whose counter did not move while ours moved this often is silent
EXITED = b"exit"
LEAVE_WAIT_S = 3.0  # rank 0 waits this long at most for the others' `exit` (Heartbeat.stop)
# ... and this long once a rank said it stops on an error: a peer not in a collective yet
# (compiling, saving) reads that error only while rank 0 still serves the store.
LEAVE_AFTER_ERROR_WAIT_S = 30.0
DEAD_S = 1.5  # a peer whose counter did not move this long while rank 0 waits to leave died
START_S = 10.0  # a peer without a heartbeat this long after rank 0's began never starts one
GIVE_UP_FAILURES = 3  # beats in a row the store did not take (each up to its 5 s timeout)


def key(rank: int) -> str:
    return f"beat/{rank}"


def node_key(rank: int) -> str:
    return f"node/{rank}"


ERROR_KEY = "error"  # the rank that stopped on a user error (Heartbeat.say_error)


@dataclass(frozen=True)
class Silence:
    """The ranks whose heartbeat stopped, and their nodes (in the same order)."""

    ranks: list[int]
    nodes: list[str]

    @property
    def node(self) -> str | None:
        """The one node every silent rank is on, if there is one: the node to blame."""
        return self.nodes[0] if self.nodes and len(set(self.nodes)) == 1 else None


def connect(addr: str, port: int, timeout_s: float = 5.0, attempt: int = 0) -> Any | None:
    """connect opens a client of the rendezvous store at addr:port (after the process group
    is up), its keys under this attempt's prefix; None where it cannot, and then the rank
    simply has no heartbeat."""
    try:
        from torch.distributed import PrefixStore, TCPStore

        return PrefixStore(f"pyrecover/attempt_{attempt}", TCPStore(
            addr, port, is_master=False, timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False))
    except Exception as exc:  # no heartbeat is no reason to stop training
        log.warning("no heartbeat: the store at %s:%d did not answer (%s)", addr, port, exc)
        return None


def start(addr: str, port: int, rank: int, world_size: int, node: str, attempt: int = 0
          ) -> Heartbeat | None:
    """start beats for this rank of a distributed job (None where the store cannot be
    reached: the job trains on without); `attempt` is torchrun's restart count."""
    store = connect(addr, port, attempt=attempt)
    if store is None:
        return None
    try:
        return Heartbeat(store, rank, world_size, node).start()
    except Exception as exc:
        log.warning("no heartbeat: %s", exc)
        return None


# What a store client says once its host closed the connection (it never reconnects): torch
# printed a 20-line C++ trace at each use after it, so there is none (ClosedStore).
CLOSED = ("broken pipe", "connection reset", "got 0 bytes", "connection refused")


class StoreClosed(ConnectionError):
    """The store's host closed this client's connection: the store is not used again."""


class ClosedStore:
    """ClosedStore is `store` until one of its uses fails because its host closed the
    connection (rank 0's process, which holds it, has left); each later use raises
    StoreClosed at once, without the C++ warning and trace torch prints for every failed
    use. A timeout (a blip, a stopped host) is not a closed connection."""

    def __init__(self, store: Any) -> None:
        self._store, self.closed = store, False

    def __getattr__(self, name: str) -> Any:
        use = getattr(self._store, name)

        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.closed:
                raise StoreClosed("the store's host closed the connection")
            try:
                return use(*args, **kwargs)
            except Exception as exc:
                self.closed = any(text in str(exc).lower() for text in CLOSED)
                raise
        return guarded


class Heartbeat:
    """Heartbeat beats for one rank in a thread (`start`), and finds silent peers (`silent`)."""

    def __init__(self, store: Any, rank: int, world_size: int, node: str,
                 every_s: float = BEAT_S) -> None:
        self.rank, self.world_size, self.node = rank, world_size, node
        self.store = ClosedStore(store)
        self._left = False  # stop() ran
        self._said_exit = True  # stop() wrote `exit`
        self._started = time.monotonic()
        self.every_s = every_s
        self._count = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        self.store.set(node_key(self.rank), self.node)
        self._started = time.monotonic()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="pyrecover-heartbeat",
                                        daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        self._count += 1
        self.store.set(key(self.rank), str(self._count))

    def _run(self) -> None:
        failed = 0
        while not self._stop.wait(self.every_s):
            try:
                self._beat()
                failed = 0
            except Exception as exc:
                # One timeout (a blip of the management network) used to end the beats for
                # good, and a hang hours later named this live rank's node as silent. Only a
                # store that stopped answering (its host left: the job is ending) ends them.
                failed += 1
                log.debug("rank %d: heartbeat not written (%s)", self.rank, exc)
                if failed >= GIVE_UP_FAILURES or self.store.closed:
                    return

    def stop(self, wait: bool = True) -> None:
        """stop ends the beats and writes `exit`, so peers never take this rank for silent;
        rank 0 then waits for the others' (`wait`; not on a hang, where the peers are stuck
        and its persist comes first). A second call does nothing.

        A trainer leaving its group stops with wait=False and waits after the group is gone
        (`wait_for_the_others`, through dist.teardown): a peer blocked in a collective on
        rank 0 gets out only then."""
        if self._left:
            return
        self._left = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.every_s + 5)
        try:
            self.store.set(key(self.rank), EXITED)
        except Exception as exc:
            log.debug("rank %d: could not write its heartbeat's exit: %s", self.rank, exc)
            self._said_exit = False
            return
        if wait:
            self.wait_for_the_others()

    def wait_for_the_others(self, wait_s: float | None = None) -> None:
        """Rank 0's process holds the store (srun, train --nproc): leaving first, it cut off
        the others' own `exit` writes, and torch printed a C++ warning per write under their
        one error line. Rank 0 waits for them, `wait_s` at most (LEAVE_WAIT_S, or
        LEAVE_AFTER_ERROR_WAIT_S once a rank said its error: a rank that died or hangs never
        writes it), and for a rank that has not beaten yet (it may be just starting: rank 0
        failed at once) until START_S, but not for one whose counter stands still DEAD_S (it
        died); the other ranks, and a rank 0 whose store no longer answered, go at once. Call
        it after `stop`."""
        if self.rank != 0 or not self._left or not self._said_exit:
            return
        others = [r for r in range(self.world_size) if r != self.rank]
        said = self.stopped_on_error() is not None  # by any rank
        bound = LEAVE_AFTER_ERROR_WAIT_S if said else LEAVE_WAIT_S
        deadline = time.monotonic() + (bound if wait_s is None else wait_s)
        dead_s = max(DEAD_S, 3 * self.every_s)  # a live peer beats on until its `exit`
        moved: dict[int, tuple[bytes, float]] = {}  # each peer's value, and since when
        while others and time.monotonic() < deadline:
            # A peer whose store client failed never beats: not waited for once START_S is past
            absent = b"" if time.monotonic() - self._started < START_S else EXITED
            try:
                values = self._read(others, absent)
            except Exception:  # the store went (torchrun's agent hosts it): nothing to wait for
                return
            now = time.monotonic()
            for r, value in values.items():
                if moved.get(r, (None,))[0] != value:
                    moved[r] = (value, now)
            # A peer that died (SIGKILL, the OOM killer) never writes `exit`: its counter
            # stands still, and waiting LEAVE_WAIT_S for it delayed every crash's restart.
            if all(v == EXITED or (v and now - moved[r][1] >= dead_s)
                   for r, v in values.items()):
                return
            time.sleep(0.05)

    def say_error(self, reason: str) -> None:
        """Record that this rank stops on a user error (`reason`, one line), before it leaves
        the group; rank 0 then waits longer for the others' `exit`."""
        try:
            self.store.set(ERROR_KEY, f"{self.rank}\n{reason}")
        except Exception as exc:
            log.debug("rank %d: could not say it stops on an error: %s", self.rank, exc)

    def stopped_on_error(self) -> tuple[int, str] | None:
        """The rank that said it stops on a user error (`say_error`) and its reason; None
        where none did or the store does not answer."""
        try:
            if not self.store.check([ERROR_KEY]):
                return None
            rank, _, reason = bytes(self.store.get(ERROR_KEY)).decode(errors="replace"
                                                                      ).partition("\n")
            return int(rank), reason
        except Exception:
            return None

    def silent(self, beats: int = WINDOW_BEATS, max_wait_s: float = 30.0,
               sleep: Callable[[float], None] = time.sleep) -> Silence | None:
        """silent names the other ranks whose counter did not move while this rank's own
        moved `beats` times (not those that exited); None where the store does not answer.

        The window is counted in this rank's own beats, not seconds: a machine too loaded to
        run the others' heartbeat threads for a while, or a paused VM, holds this rank's
        thread back as well, so a live peer is not taken for silent."""
        others = [r for r in range(self.world_size) if r != self.rank]
        try:
            before = self._read(others)
            mine, waited = self._count, 0.0
            while self._count < mine + beats and waited < max_wait_s:
                sleep(self.every_s / 4)
                waited += self.every_s / 4
            after = self._read(others)
            quiet = [r for r in others if after[r] == before[r] and after[r] != EXITED]
            nodes = [self.store.get(node_key(r)).decode(errors="replace") for r in quiet]
        except Exception as exc:
            log.warning("rank %d: the heartbeat store did not answer (%s); no silent rank "
                        "named", self.rank, exc)
            return None
        return Silence(quiet, nodes)

    def _read(self, ranks: list[int], absent: bytes = EXITED) -> dict[int, bytes]:
        # A rank without a heartbeat (its store client failed, or it has not started one
        # yet) has no key: a get would block. It reads as `absent`.
        keys = [key(r) for r in ranks if self.store.check([key(r)])]
        values = self.store.multi_get(keys) if hasattr(self.store, "multi_get") else [
            self.store.get(k) for k in keys]
        found = {int(k.rsplit("/", 1)[1]): bytes(v) for k, v in zip(keys, values, strict=True)}
        return {r: found.get(r, absent) for r in ranks}
