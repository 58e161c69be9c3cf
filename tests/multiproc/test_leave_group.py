"""A rank 0 that fails alone (a run directory it may not read, a wandb it cannot start) lets
its peers go at once: leaving the group (dist.teardown) frees a peer blocked in a collective
on it, and rank 0 still serves the group's store while the peer writes its heartbeat's
`exit`. Before, torch._dynamo (which DDP and compile import) held the group, so the peer got
out only when rank 0's process ended, three seconds later, and its write raced that end: a
C++ TCPStore warning under the user's one error line, now and then."""

from __future__ import annotations

import importlib

import pytest
from helpers import run_ranks

from pyrecover import dist, heartbeat

pytestmark = pytest.mark.multiproc

WAIT_S = 120.0  # rank 0's bound for rank 1's `exit`; far past a busy machine's lag


def _rank(rank: int, port: int) -> None:
    env = dist.DistEnv("single", rank, 2, rank, 2, 0, "127.0.0.1", port)
    dist.setup(env, "cpu", timeout_s=600)
    importlib.import_module("torch._dynamo")  # as the trainer does, after the group
    beats = heartbeat.start(env.master_addr, env.master_port, rank, 2, "n")
    assert beats is not None
    if rank == 1:
        with pytest.raises(Exception):  # noqa: B017 (gloo's error class varies by version)
            dist.gather_objects("rank 1", 2)  # rank 0 never joins: freed when it leaves
        beats.stop(wait=False)
        dist.teardown()
        return
    beats.stop(wait=False)
    seen: list[bytes] = []

    def saw() -> None:
        beats.wait_for_the_others(wait_s=WAIT_S)
        seen.append(bytes(beats.store.get(heartbeat.key(1))))

    dist.teardown(then=saw)
    assert seen == [heartbeat.EXITED]


def test_a_peer_blocked_on_a_failed_rank_0_leaves_before_it_and_says_so():
    run_ranks(_rank, group=False, timeout=2 * WAIT_S + 120)
