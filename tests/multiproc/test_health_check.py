"""The health check in the trainer, with real gloo process groups: a healthy start records
one passed `health` event; a node that fails exits 77 with one line and a `health` event
naming the node and the check, before training starts; `run.health_check=false` skips it."""

from __future__ import annotations

import json
import socket

import pytest
from helpers import events, pyrecover, tiny_args

pytestmark = pytest.mark.multiproc

SHORT = ("train.max_steps=2", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
         "model.block_size=32", "train.global_batch_size=4", "train.micro_batch_size=2")


def test_a_healthy_start_passes_the_check_and_records_it(tmp_path, corpus):
    done = pyrecover("train", "--nproc", "2", *tiny_args(tmp_path, corpus, "ok", *SHORT))
    assert done.returncode == 0, done.stderr[-3000:]
    [passed] = events(tmp_path / "ok", "health")
    assert passed["ok"] is True and passed["ranks"] == 2
    assert 0 <= passed["seconds"] < 60 and passed["collective_seconds"] >= 0
    assert events(tmp_path / "ok", "finish")


def test_a_failing_node_exits_77_with_one_line_and_an_event_before_training(tmp_path, corpus):
    node = socket.gethostname()  # no SLURM here: the node's name is the host's
    done = pyrecover("train", "--nproc", "2", *tiny_args(tmp_path, corpus, "bad", *SHORT),
                     env={"PYRECOVER_HEALTH_FAIL": node, "PYRECOVER_HEALTH_FAIL_CHECK": "memory"})
    assert done.returncode == 77, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if "health check failed" in line]
    assert lines and all(line.startswith(f"pyrecover: health check failed on node {node} (rank ")
                         and line.endswith("memory: fault injected (PYRECOVER_HEALTH_FAIL)")
                         for line in lines)
    failed = events(tmp_path / "bad", "health")
    assert failed and {(e["ok"], e["node"], e["check"]) for e in failed} == {
        (False, node, "memory")}
    assert not events(tmp_path / "bad", "start")  # nothing trained, nothing to resume
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_the_check_can_be_turned_off(tmp_path, corpus):
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "off", *SHORT,
                                         "run.health_check=false"),
                     env={"PYRECOVER_HEALTH_FAIL": socket.gethostname()})
    assert done.returncode == 0, done.stderr[-3000:]
    assert events(tmp_path / "off", "health") == []


def test_a_checkpoints_folder_on_a_filesystem_with_no_room_fails_before_training(tmp_path,
                                                                                 corpus):
    """checkpoints/ a link to another filesystem (here /proc/1: no space, nothing can be
    created) under a writable run folder: the start fails its check at once, where it used
    to train to the end and fail only at its final save."""
    run = tmp_path / "linked"
    run.mkdir()
    (run / "checkpoints").symlink_to("/proc/1")
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "linked", *SHORT))
    assert done.returncode == 77, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if "health check failed" in line]
    assert f"storage_space: 0.0 MiB free under {run / 'checkpoints'}" in line, line
    assert not events(run, "start") and not (run / "metrics.jsonl").exists()
    shown = pyrecover("status", str(run), "--json")  # what failed, not "not started"
    assert shown.returncode == 0, shown.stderr
    report = json.loads(shown.stdout)
    assert report["state"] == "health check failed"
    assert report["last_error"] == line.removeprefix("pyrecover: ")
