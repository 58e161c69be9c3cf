"""An asynchronous DCP save copies the state in the background; the next update must not leak
into it, and the loop is charged for any wait."""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pyrecover.bench import build_state
from pyrecover.checkpoint import CheckpointManager, store
from pyrecover.model import GPT, GPTConfig
from pyrecover.rundir import RunDir


@pytest.fixture(autouse=True)
def _no_process_group_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class SlowCopy:
    """Stands in for a slow device-to-host copy: DCP's staging, started 0.5 s late."""

    def __init__(self, stager) -> None:
        self.stager, self.stage_real = stager, stager._state_dict_stager.stage

    def __enter__(self):
        def late(*args, **kwargs):
            time.sleep(0.5)
            return self.stage_real(*args, **kwargs)
        self.stager._state_dict_stager.stage = late
        return self

    def __exit__(self, *exc) -> None:
        self.stager._state_dict_stager.stage = self.stage_real


def test_an_update_right_after_an_async_save_never_reaches_that_save(tmp_path):
    state = build_state(2_000_000)  # a small GPT + AdamW with every optimizer slot filled
    parts = state.parts
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 2, 2, 0, 1, parts, torch.device("cpu"), True)
    saved = {k: v.clone() for k, v in parts.model.state_dict().items()}
    with SlowCopy(manager.mode.stager):
        blocked = manager.at_step(2)
        assert blocked < 0.4  # the copy runs in the background
        waited = manager.before_update()  # what the loop calls before optimizer.step
    assert waited > 0.1  # the copy was not done: the loop waited, and is charged for it
    for p in parts.model.parameters():  # the update the save must not see
        p.data.add_(1.0)
    manager.finish(2)
    ckpt = store.verify(run.checkpoints / "step-2")
    fresh = {"model": GPT(GPTConfig(**state.shape)).state_dict()}
    dcp.load(fresh, checkpoint_id=str(ckpt.path), no_dist=True)
    for key, value in fresh["model"].items():
        assert torch.equal(value, saved[key]), key
    events = [e for e in run.read_events() if e["event"] == "checkpoint"]
    assert events[-1]["blocked"] >= waited
