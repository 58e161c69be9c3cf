"""`train.profile: A-B` records those steps with torch.profiler (profiling.py): a trace and an
operator table per rank, the per-step figures in rank 0's log and a `profile` event, and
nothing else changes: a profiled run trains what an unprofiled one trains."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import events, pyrecover, tiny_args

from pyrecover import config as config_mod
from pyrecover import profiling
from pyrecover.preempt import EXIT_STOPPED
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
        assert optimizer_steps(stem.with_name(stem.name + ".trace.json.gz")) == 3
        assert "aten::mm" in stem.with_name(stem.name + ".txt").read_text()
    assert not (plain / "profile").exists()
    shown = pyrecover("status", str(profiled))
    assert "profile     steps 3-5, per step: wall " in shown.stdout, shown.stdout
    assert json.loads(pyrecover("status", str(profiled), "--json").stdout)["profile"][
        "trace"] == event["trace"]


def optimizer_steps(trace) -> int:
    """optimizer_steps counts the optimizer's updates a trace recorded: one per step."""
    with gzip.open(trace, "rt") as f:
        names = [e.get("name", "") for e in json.load(f)["traceEvents"]]
    assert "aten::mm" in names
    return sum(name.startswith("Optimizer.step#") for name in names)


def test_a_run_resumed_just_before_its_window_records_the_window(tmp_path, corpus):
    run(tmp_path, corpus, "again", "train.max_steps=4")
    run(tmp_path, corpus, "again", "train.profile=5-6")
    [event] = events(tmp_path / "again", "profile")
    assert (event["first"], event["last"], event["steps"]) == (5, 6, 2)
    assert optimizer_steps(tmp_path / "again" / "profile" / "steps-5-6-rank-0.trace.json.gz") == 2


def test_a_profile_that_cannot_be_written_is_a_warning_and_the_run_goes_on(tmp_path, corpus):
    run(tmp_path, corpus, "full", "train.max_steps=2")
    (tmp_path / "full" / "profile").write_text("a file where the folder goes")
    done = run(tmp_path, corpus, "full", "train.profile=3-4")
    assert "profile of steps 3-4 not written: FileExistsError" in done.stderr
    assert not events(tmp_path / "full", "profile")
    assert events(tmp_path / "full", "finish")[-1]["step"] == 8


def test_a_run_that_ends_inside_its_window_writes_the_steps_it_recorded(tmp_path, corpus):
    run(tmp_path, corpus, "short", "train.profile=6-20")
    [event] = events(tmp_path / "short", "profile")
    assert (event["first"], event["last"], event["steps"]) == (6, 8, 3)
    assert (tmp_path / "short" / "profile" / "steps-6-8-rank-1.trace.json.gz").is_file()


def test_a_stop_inside_the_window_writes_the_steps_up_to_the_stop(tmp_path, corpus):
    run_dir = tmp_path / "stopped"
    argv = ["train", "--nproc", "2", *tiny_args(
        tmp_path, corpus, "stopped", "train.device=cpu", "train.max_steps=500",
        "train.log_interval=1", "checkpoint.interval=1000", "train.profile=5-54")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    # 0.2 s a step: steps 8 to 54 take far longer than a poller starved by a busy machine
    # may lag, so the signal lands inside the window.
    env["PYRECOVER_STEP_DELAY"] = "0.2"
    proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *argv], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:  # waits for step 8's record
        if max((m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")), default=0) >= 8:
            os.killpg(proc.pid, signal.SIGUSR2)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    [stop] = events(run_dir, "stop")
    [event] = events(run_dir, "profile")
    assert (event["first"], event["last"]) == (5, stop["step"]) and stop["step"] < 54
    for rank in (0, 1):
        trace = run_dir / "profile" / f"steps-5-{stop['step']}-rank-{rank}.trace.json.gz"
        assert optimizer_steps(trace) == event["steps"] == stop["step"] - 4


@pytest.mark.parametrize("value", ["0-2", "5-3", "x", "2-", "1-2-3", "1-51"])
def test_a_window_that_is_not_steps_a_to_b_is_refused_by_name(value):
    with pytest.raises(config_mod.ConfigError, match=r"^train\.profile=.* is not allowed"):
        config_mod.load(None, [f"train.profile={value}"])


def test_a_window_after_the_last_step_is_refused_not_silently_skipped():
    with pytest.raises(config_mod.ConfigError, match=r"^train\.profile='9-10' is not allowed: .*"
                                                     r"max_steps=8: the run never reaches step 9"):
        config_mod.load(None, ["train.profile=9-10", "train.max_steps=8"])
    config_mod.load(None, ["train.profile=8-10", "train.max_steps=8"])  # cut to step 8


def test_the_device_times_count_overlapping_kernels_once_and_copies_by_direction():
    def ev(name, start, end, device="CUDA", annotation=False):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device),
                               time_range=SimpleNamespace(start=start, end=end),
                               is_user_annotation=annotation)

    found = profiling.device_times([
        ev("ampere_gemm", 0, 100), ev("triton_fused", 50, 150),  # two streams at once
        ev("triton_red", 200, 250), ev("Memcpy DtoH (Device -> Pinned)", 0, 300),
        ev("Memcpy HtoD (Pinned -> Device)", 300, 310), ev("Memset (Device)", 0, 5),
        ev("aten::mm", 0, 1000, device="CPU"), ev("Stream Wait Event", 150, 200),
        ev("Optimizer.step#AdamW.step", 200, 900, annotation=True)])  # a span, not a kernel
    assert found == {"kernels": 200e-6, "to_host": 300e-6, "to_device": 10e-6,
                     "device_events": 3.0}
    step = profiling.per_step(found, wall=1e-3, steps=2)
    assert step == {"wall_s": 5e-4, "kernels_s": 1e-4, "idle_s": 4e-4, "to_host_s": 1.5e-4,
                    "to_device_s": 5e-6}
