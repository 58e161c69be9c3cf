"""A rank 0 that fails alone (a run directory it may not read, a wandb it cannot start) lets
its peers go at once: leaving the group (dist.teardown) frees a peer blocked in a collective
on it, and rank 0 still serves the group's store while the peer writes its heartbeat's
`exit`. Before, torch._dynamo (which DDP and compile import) held the group, so the peer got
out only when rank 0's process ended, three seconds later, and its write raced that end: a
C++ TCPStore warning under the user's one error line, now and then."""

from __future__ import annotations

import importlib
import traceback

import pytest

from pyrecover import dist, heartbeat, spawn

pytestmark = pytest.mark.multiproc

WAIT_S = 120.0  # rank 0's bound for rank 1's `exit`; far past a busy machine's lag


def _rank(rank: int, port: int, results) -> None:
    try:
        env = dist.DistEnv("single", rank, 2, rank, 2, 0, "127.0.0.1", port)
        dist.setup(env, "cpu", timeout_s=600)
        importlib.import_module("torch._dynamo")  # as the trainer does, after the group
        beats = heartbeat.start(env.master_addr, env.master_port, rank, 2, "n")
        assert beats is not None
        if rank == 1:
            try:  # rank 0 never joins it: this rank waits in it until rank 0 leaves
                dist.gather_objects("rank 1", 2)
                results.put("rank 1: its collective completed without rank 0")
            except Exception:
                results.put("rank 1 freed")
            beats.stop(wait=False)
            dist.teardown()
            return
        beats.stop(wait=False)

        def saw() -> None:
            beats.wait_for_the_others(wait_s=WAIT_S)
            value = bytes(beats.store.get(heartbeat.key(1)))
            results.put(f"rank 0 saw rank 1's {value.decode()}")

        dist.teardown(then=saw)
    except BaseException:
        results.put(f"rank {rank}: {traceback.format_exc()}")
        raise


def test_a_peer_blocked_on_a_failed_rank_0_leaves_before_it_and_says_so():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = spawn.free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=2 * WAIT_S + 120)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    said = []
    while not results.empty():
        said.append(results.get())
    assert sorted(said) == ["rank 0 saw rank 1's exit", "rank 1 freed"], said
    assert [p.exitcode for p in procs] == [0, 0], said
