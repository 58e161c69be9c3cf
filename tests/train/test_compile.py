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


def test_a_restart_on_a_new_node_finds_the_compiled_kernels_in_the_run_directory(
        tmp_path, corpus):
    """A requeued job lands on another node, whose /tmp (Inductor's default cache) never saw
    this run: each attempt gets a fresh TMPDIR, and the second must still compile nothing."""
    run = tmp_path / "run"

    def attempt(steps: int, node: str):
        (tmp_path / node).mkdir()
        env = {"TMPDIR": str(tmp_path / node), "TORCHINDUCTOR_CACHE_DIR": ""}
        done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.compile=true",
                                             f"train.max_steps={steps}"), env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        return [e for e in read_jsonl(run / "events.jsonl")
                if e.get("phase") == "first_step"][-1]["compile_cache"]

    first = attempt(2, "node1")
    assert first["hits"] == 0 and first["misses"] > 0
    assert (run / "compile-cache" / "fxgraph").is_dir()
    again = attempt(4, "node2")
    assert again == {"hits": first["misses"], "misses": 0}
    shown = pyrecover("status", str(run))
    assert f"(compile cache: {first['misses']} hits, 0 misses)" in shown.stdout
