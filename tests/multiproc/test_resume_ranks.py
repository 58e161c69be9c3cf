"""A checkpoint rank 0 chose that another rank cannot read (its node's view of the storage is
behind: NFS a moment after rank 0's rename) is one that cannot be restored: every rank falls
back to the previous checkpoint together, and none exits as if the user had erred (exit 2
ends the run for good; the job script requeues anything else).

Two real gloo ranks resume a real run directory through relative paths, each from its own
working directory: the same files, except that rank 1's copy has no step-4 yet.
"""

from __future__ import annotations

import os
import shutil
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as tdist
import torch.multiprocessing as mp

from pyrecover import dist, spawn
from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager
from pyrecover.rundir import RunDir, read_jsonl

pytestmark = pytest.mark.multiproc
BYTES = 200_000


def _rank(rank: int, port: int, views: list[str], results, mode: str) -> None:
    try:
        tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                 world_size=2, timeout=timedelta(seconds=60))
        os.chdir(views[0])  # one storage while saving
        state = build_state(BYTES, seed=0)
        manager = CheckpointManager(RunDir(Path("run")), mode, 2, 3, rank, 2, state.parts)
        for step in (2, 4):
            manager.at_step(step)
        manager.finish(4)
        tdist.barrier()
        if rank == 1:  # this node's view: step-4 not there yet
            shutil.copytree(Path(views[0]) / "run", Path(views[1]) / "run")
            shutil.rmtree(Path(views[1]) / "run" / "checkpoints" / "step-4")
            os.chdir(views[1])
        tdist.barrier()
        loader = CheckpointManager(RunDir(Path("run")), mode, 2, 3, rank, 2,
                                   build_state(BYTES, seed=1).parts)
        found = loader.resume()
        results.put((rank, found[0].step if found else None, loader.last_saved_step))
        loader.mode.close()
        tdist.barrier()  # rank 0 reads nothing more: the group goes down together
    except BaseException:
        results.put((rank, traceback.format_exc(), None))
        raise
    finally:
        dist.teardown()


@pytest.mark.parametrize("mode", ["vanilla", "dcp"])
def test_a_checkpoint_another_rank_cannot_read_falls_back_on_every_rank(tmp_path, mode):
    """dcp: the ranks that could read the checkpoint entered DCP's load, whose collectives
    waited for the rank that could not, while that rank waited for them in the count of
    failures: a hang until the process group's timeout."""
    views = [tmp_path / "rank0", tmp_path / "rank1"]
    for view in views:
        view.mkdir()
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = spawn.free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, [str(v) for v in views], results, mode))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=180)
    got = {}
    while not results.empty():
        rank, step, saved = results.get()
        got[rank] = (step, saved)
    assert got == {0: (2, 2), 1: (2, 2)}, got
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    run = views[0] / "run"
    invalid = [e for e in read_jsonl(run / "events.jsonl") if e["event"] == "checkpoint_invalid"]
    assert [e["step"] for e in invalid] == [4]
    assert "rank 1: " in invalid[0]["reason"] and "no manifest.json" in invalid[0]["reason"]
    assert (run / "checkpoints" / "step-4" / "manifest.json").is_file()  # kept for later
