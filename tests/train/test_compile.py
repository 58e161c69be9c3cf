"""`train.compile`: compiled and eager runs share one checkpoint format.

The compile path runs here on the CPU (inductor with the machine's C compiler) as it runs on a
GPU: the model is compiled in place, so its parameter names never carry `_orig_mod.`.
"""

from __future__ import annotations

import pytest
import torch
from helpers import pyrecover, tiny_args

from pyrecover.rundir import read_jsonl


@pytest.mark.parametrize("mode", ["dcp"])
def test_a_compiled_run_resumes_an_eager_checkpoint_and_the_reverse(tmp_path, corpus, mode):
    def train(steps: int, compiled: str):
        done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", f"train.max_steps={steps}",
                                             f"train.compile={compiled}",
                                             f"checkpoint.mode={mode}", "checkpoint.interval=4"))
        assert done.returncode == 0, done.stderr
        return done

    train(4, "false")
    done = train(8, "true")
    assert "resumed from" in done.stderr and "(step 4," in done.stderr
    exported = tmp_path / "model.pt"
    done = pyrecover("ckpt", "export", str(tmp_path / "run"), "--out", str(exported))
    assert done.returncode == 0, done.stderr
    keys = list(torch.load(exported, weights_only=True, map_location="cpu"))
    assert keys and not [k for k in keys if "_orig_mod" in k]
    done = train(12, "false")
    assert "(step 8," in done.stderr
    losses = [m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 12 and all(x == x for x in losses)  # finite, every step logged
