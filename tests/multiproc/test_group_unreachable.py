"""A process group that does not form is one line a user can act on, not a traceback: a rank
whose rank 0 never comes (its node died before it listened, a wrong MASTER_ADDR), and a rank 0
whose peers never come, say where they waited and for how long (exit 1, a fault)."""

from __future__ import annotations

import pytest
from helpers import run_ranks

from pyrecover import dist, spawn
from pyrecover.cli.app import FAULTS

pytestmark = pytest.mark.multiproc


def _join_alone(rank: int, _port: int, alone: int) -> None:
    """Rank `alone` of a group of two joins; its peer never does (this process's other rank
    returns at once), at a port nobody else listens on."""
    if rank != alone:
        return
    env = dist.DistEnv("single", alone, 2, 0, 1, 0, "127.0.0.1", spawn.free_port())
    with pytest.raises(dist.GroupUnreachable) as err:
        dist.setup(env, "cpu", timeout_s=3)
    said = str(err.value)
    assert "\n" not in said, said
    assert said.startswith(f"rank {alone} could not join the process group at "
                           f"127.0.0.1:{env.master_port} (torch's timeout 3 s: "), said
    assert ".)" not in said, said
    assert said.endswith("a rank did not start, or this node cannot reach that address; see "
                         "the other ranks' output"), said


@pytest.mark.parametrize("alone", [1, 0], ids=["rank 1 without rank 0", "rank 0 without rank 1"])
def test_a_group_that_does_not_form_is_one_line_naming_the_address(alone):
    run_ranks(_join_alone, alone, group=False, timeout=120)
    assert ("pyrecover.dist", "GroupUnreachable") in FAULTS  # said in one line, exit 1
