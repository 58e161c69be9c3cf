"""`train.profile: A-B` records those steps with torch.profiler (profiling.py): a trace and an
operator table per rank, the per-step figures in rank 0's log and a `profile` event, and
nothing else changes: a profiled run trains what an unprofiled one trains."""

from __future__ import annotations

import gzip
import json
from types import SimpleNamespace

import pytest
import torch
from helpers import events, pyrecover, tiny_args

from pyrecover import config as config_mod
from pyrecover import profiling
from pyrecover.rundir import read_jsonl


def run(tmp_path, corpus, name, *extra):
    done = pyrecover("train", "--nproc", "2", *tiny_args(
        tmp_path, corpus, name, "train.device=cpu", "train.max_steps=8",
        "checkpoint.interval=100", *extra))
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def test_a_profiled_run_trains_what_an_unprofiled_one_does_and_leaves_a_trace_per_rank(
        tmp_path, corpus):
    run(tmp_path, corpus, "plain")
    done = run(tmp_path, corpus, "profiled", "train.profile=3-5")
    plain, profiled = tmp_path / "plain", tmp_path / "profiled"
    assert [m["loss"] for m in read_jsonl(profiled / "metrics.jsonl")] == \
        [m["loss"] for m in read_jsonl(plain / "metrics.jsonl")]
    a, b = (torch.load(r / "checkpoints" / "step-8" / "state.pt", weights_only=True)["model"]
            for r in (plain, profiled))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    [event] = events(profiled, "profile")
    assert (event["first"], event["last"], event["steps"]) == (3, 5, 3)
    assert event["wall_s"] > 0 and "kernels_s" not in event  # a CPU: no device times
    assert "profile of steps 3-5, per step: wall" in done.stderr
    for rank in (0, 1):
        stem = profiled / "profile" / f"steps-3-5-rank-{rank}"
        with gzip.open(stem.with_name(stem.name + ".trace.json.gz"), "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert "aten::mm" in names and "aten::mm" in stem.with_name(stem.name + ".txt").read_text()
    assert not (plain / "profile").exists()


def test_a_run_that_ends_inside_its_window_writes_the_steps_it_recorded(tmp_path, corpus):
    run(tmp_path, corpus, "short", "train.profile=6-20")
    [event] = events(tmp_path / "short", "profile")
    assert (event["first"], event["last"], event["steps"]) == (6, 8, 3)
    assert (tmp_path / "short" / "profile" / "steps-6-8-rank-1.trace.json.gz").is_file()


@pytest.mark.parametrize("value", ["0-2", "5-3", "x", "2-", "1-2-3"])
def test_a_window_that_is_not_steps_a_to_b_is_refused_by_name(value):
    with pytest.raises(config_mod.ConfigError, match=r"^train\.profile=.* is not allowed"):
        config_mod.load(None, [f"train.profile={value}"])


def test_the_device_times_count_overlapping_kernels_once_and_copies_by_direction():
    def ev(name, start, end, device="CUDA"):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                               time_range=SimpleNamespace(start=start, end=end))

    found = profiling.device_times([
        ev("ampere_gemm", 0, 100), ev("triton_fused", 50, 150),  # two streams at once
        ev("triton_red", 200, 250), ev("Memcpy DtoH (Device -> Pinned)", 0, 300),
        ev("Memcpy HtoD (Pinned -> Device)", 300, 310), ev("Memset (Device)", 0, 5),
        ev("aten::mm", 0, 1000, device="CPU")])
    assert found == {"kernels": 200e-6, "to_host": 300e-6, "to_device": 10e-6,
                     "device_events": 3.0}
    step = profiling.per_step(found, wall=1e-3, steps=2)
    assert step == {"wall_s": 5e-4, "kernels_s": 1e-4, "idle_s": 4e-4, "to_host_s": 1.5e-4,
                    "to_device_s": 5e-6}
