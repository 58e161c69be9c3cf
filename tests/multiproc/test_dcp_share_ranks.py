"""DCP mode at world size 2 (real gloo ranks): each rank stages only its share of a replicated
(DDP) state, half the host memory of the whole, and the checkpoint still holds every tensor."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import run_ranks

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, share, store
from pyrecover.model import GPT, GPTConfig
from pyrecover.rundir import RunDir

pytestmark = pytest.mark.multiproc
BYTES = 4_000_000


def _scenario(rank: int, root: str) -> None:
    state = build_state(BYTES, seed=0)  # the same state on both ranks, as with DDP
    run = RunDir(Path(root) / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 2, 2, rank, 2, state.parts)
    manager.at_step(2)
    manager.before_update()
    staged = sum(b.numel() * b.element_size()
                 for b in manager.mode.stager._buffers.values())
    manager.finish(2)
    whole = sum(t.numel() * t.element_size()
                for t in state.parts.model.state_dict().values())
    whole += sum(t.numel() * t.element_size() for s in state.parts.optimizer.state.values()
                 for t in s.values())
    # Half of the state, give or take the largest tensor (the embedding).
    largest = max(p.numel() * p.element_size() for p in state.parts.model.parameters())
    assert staged <= whole / 2 + largest, (rank, staged, whole)
    assert staged >= whole / 2 - largest, (rank, staged, whole)
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    from torch.distributed.tensor import Shard, distribute_tensor
    sharded = {"w": distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])}
    assert not share.replicated(sharded) and share.replicated({"w": torch.zeros(2)})


def test_each_rank_stages_half_the_state_and_the_checkpoint_holds_all_of_it(tmp_path):
    run_ranks(_scenario, str(tmp_path), timeout=180)

    ckpt = store.verify(tmp_path / "run" / "checkpoints" / "step-2")
    expected = build_state(BYTES, seed=0)
    fresh = GPT(GPTConfig(**expected.shape))
    loaded = {"model": fresh.state_dict()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(loaded, checkpoint_id=str(ckpt.path), no_dist=True)
    for key, value in expected.parts.model.state_dict().items():
        got = loaded["model"][key]
        # Seen once in a full run under load (wte.weight, the tied table), never alone: say
        # how it differed, for whoever meets it next.
        assert torch.equal(got, value), (
            f"{key}: {int((got != value).sum())} of {value.numel()} elements differ, at most "
            f"by {float((got - value).abs().max()):.3g}; first at flat index "
            f"{int((got != value).reshape(-1).nonzero()[0])}; files {ckpt.manifest['files']}")
    files = [n for n in ckpt.manifest["files"] if n.endswith(".distcp")]
    assert {n.split("_")[2] for n in files} == {"0", "1"}, files  # both ranks wrote
