"""dist.check_own_gpus over a real gloo group: where SLURM shows each task one GPU, the ranks
compare them once the group is up, so two ranks on one GPU end with one line, not NCCL's
traceback. The GPUs' UUIDs are given here (the CPU has none); tests/gpu runs it on a GPU."""

from __future__ import annotations

import pytest
from helpers import run_ranks

from pyrecover import dist

pytestmark = pytest.mark.multiproc


def _scenario(rank: int, uuids: tuple[str, ...]) -> None:
    env = dist.detect({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1"})
    if uuids[0] != uuids[1]:
        dist.check_own_gpus(env, uuids[rank])
        assert dist.gather_objects(rank, 2) == [0, 1]  # the group is still up
        return
    with pytest.raises((dist.DistError, SystemExit)) as stopped:
        dist.check_own_gpus(env, uuids[rank])
    if rank == 0:  # rank 0 says why, once
        assert "ranks 0 and 1 on" in str(stopped.value) and "GPU-same" in str(stopped.value)
    else:
        assert isinstance(stopped.value, SystemExit) and stopped.value.code == 2


@pytest.mark.parametrize("uuids", [("GPU-0", "GPU-1"), ("GPU-same", "GPU-same")])
def test_ranks_with_their_own_gpu_go_on_and_two_on_one_gpu_stop_with_one_line(uuids):
    run_ranks(_scenario, uuids)
