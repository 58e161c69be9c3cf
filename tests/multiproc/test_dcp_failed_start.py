"""A DCP save that fails on one rank before its background write starts (its RNG file hits a
full disk) is discarded on every rank like any failed write, and training goes on."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from helpers import events, run_ranks

from pyrecover.bench import state as bench
from pyrecover.checkpoint import CheckpointManager, store
from pyrecover.rundir import RunDir

pytestmark = pytest.mark.multiproc


def _scenario(rank: int, root: str, async_save: bool) -> None:
    run = RunDir(Path(root) / "run")
    if rank == 0:
        run.create()
    tdist.barrier()
    parts = bench.build_state(400_000, seed=0).parts
    manager = CheckpointManager(run, "dcp", 2, 2, rank, 2, parts, torch.device("cpu"),
                                async_save)
    unlimited = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # rank 1's disk is full: no file of its can grow past 1 KiB (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, unlimited[1]))
    manager.at_step(2)
    manager.before_update()
    manager.commit_inflight()  # every rank learns the save failed, together
    resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
    assert manager.last_saved_step is None and manager.failed_step == 2
    assert "rank 1: OSError: [Errno 27] File too large" in manager.last_error
    manager.at_step(4)  # the run goes on, and the next save is whole
    manager.finish(4)
    assert manager.last_saved_step == 4


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_failing_on_one_rank_before_its_write_is_discarded_and_the_run_goes_on(
        tmp_path, async_save):
    run_ranks(_scenario, str(tmp_path), async_save)
    root = tmp_path / "run" / "checkpoints"
    assert [step for step, _ in store.committed_steps(root)] == [4]
    assert [e["step"] for e in events(tmp_path / "run", "checkpoint_failed")] == [2]
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
