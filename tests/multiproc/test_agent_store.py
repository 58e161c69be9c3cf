"""Under torchrun the process group meets in its agent's store, which outlives each attempt's
workers: after `torchrun --max-restarts` restarted them, a rank that looked up a peer before
that peer wrote its address read the last attempt's, and waited to connect to a process long
dead (gloo's "Connect timeout" after the group's timeout; NCCL ids on GPUs). Each attempt
now meets in a store of its own (dist.rendezvous). Real gloo, a real TCPStore as the agent's.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from helpers import run_ranks

from pyrecover import dist, spawn

pytestmark = pytest.mark.multiproc


def _attempt(rank: int, _port: int, agent_port: int, attempt: int, keys_before: int) -> None:
    import os

    import torch
    from torch.distributed import TCPStore

    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # as torchrun's workers have it
    env = dist.DistEnv("torchrun", rank, 2, rank, 2, 0, "127.0.0.1", agent_port,
                       attempt=attempt, agent_store=True)
    if rank == 1 and attempt > 0:  # rank 0 is in its rendezvous first, and looks rank 1 up
        agent = TCPStore("127.0.0.1", agent_port, is_master=False,
                         timeout=timedelta(seconds=60), wait_for_workers=False)
        deadline = time.monotonic() + 120
        while agent.num_keys() <= keys_before:
            assert time.monotonic() < deadline, "rank 0 wrote no key of this attempt"
            time.sleep(0.01)
    dist.setup(env, "cpu", timeout_s=30)  # the timeout gloo's connect waits for a dead peer
    total = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(total)
    assert total.item() == 3.0


def test_a_restarted_attempt_meets_its_own_peers_not_the_last_attempts():
    from torch.distributed import TCPStore

    agent_port = spawn.free_port()
    agent = TCPStore("127.0.0.1", agent_port, is_master=True, wait_for_workers=False,
                     timeout=timedelta(seconds=60), multi_tenant=True)
    run_ranks(_attempt, agent_port, 0, 0, group=False, timeout=200)
    keys = agent.num_keys()
    assert keys > 0  # the first attempt's keys stay in the agent's store
    run_ranks(_attempt, agent_port, 1, keys, group=False, timeout=200)
    del agent
