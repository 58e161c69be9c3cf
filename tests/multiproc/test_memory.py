"""Memory mode: a rank dies, the survivors persist what they hold, the run resumes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import events, load_export, pyrecover, tiny_args

from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc

# World size 4, every step snapshotted and replicated twice, no disk checkpoint in 20 steps.
MEMORY = ("checkpoint.mode=memory", "checkpoint.snapshot_interval=1", "checkpoint.replicas=2",
          "checkpoint.interval=100", "train.global_batch_size=16", "train.max_steps=20")


def train(storage: Path, corpus: Path, name: str, nproc: int, *extra: str, env=None):
    return pyrecover("train", "--nproc", str(nproc), *tiny_args(storage, corpus, name, *extra),
                     env=env)


def kill(ranks: str, step: int, point: str = "step") -> dict[str, str]:
    return {"PYRECOVER_KILL_AT_STEP": str(step), "PYRECOVER_KILL_RANK": ranks,
            "PYRECOVER_KILL_TARGET": "self", "PYRECOVER_KILL_POINT": point}


def export(run_dir: Path) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    done = pyrecover("ckpt", "export", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    model = load_export(out)
    # The model alone: not the optimizer state that shared its bytes on restore.
    tensor_bytes = sum(t.numel() * t.element_size() for t in model.values())
    assert out.stat().st_size < 1.2 * tensor_bytes + (64 << 10)
    return model


def test_a_killed_rank_costs_no_more_than_one_snapshot_and_the_result_is_bitwise(tmp_path,
                                                                                  corpus):
    ref = train(tmp_path, corpus, "ref", 4, *MEMORY)
    assert ref.returncode == 0, ref.stderr

    crashed = train(tmp_path, corpus, "run", 4, *MEMORY, env=kill("2", 12))
    run_dir = tmp_path / "run"
    assert crashed.returncode != 0
    assert "another rank of the job died" in crashed.stderr
    assert "Traceback" not in crashed.stderr
    assert sorted(e["rank"] for e in events(run_dir, "snapshot_persisted")) == [0, 1, 3]
    assert not events(run_dir, "checkpoint"), "no disk checkpoint was due"
    # The launcher saw why: status names the killed rank, not a survivor's connection reset.
    status = pyrecover("status", str(run_dir))
    assert ("last error  rank 2 was killed by SIGKILL from outside pyrecover (the kernel's "
            "OOM killer, or kill -9)") in status.stdout, status.stdout

    resumed = train(tmp_path, corpus, "run", 4, *MEMORY)
    assert resumed.returncode == 0, resumed.stderr
    (resume,) = events(run_dir, "resume")
    assert resume["step"] in (11, 12)
    assert events(run_dir, "snapshot_recovered")[0]["step"] == resume["step"]
    ref_model, model = export(tmp_path / "ref"), export(run_dir)
    assert ref_model.keys() == model.keys()
    for key in ref_model:
        assert torch.equal(ref_model[key], model[key]), key


def test_losing_both_holders_of_a_slice_falls_back_to_the_disk_checkpoint(tmp_path, corpus):
    # With replicas on the next rank, slice 1 lives on ranks 1 and 2 only. They die at step
    # 9's snapshot, after the exchange of step 8 finished on every rank: the survivors' newest
    # complete snapshot is step 8 however the machine schedules the processes (killed right
    # after step 8, a slow exchange made it step 7 now and then).
    extra = (*MEMORY, "checkpoint.interval=5")
    crashed = train(tmp_path, corpus, "run", 4, *extra, env=kill("1,2", 9, "snapshot"))
    assert crashed.returncode != 0
    run_dir = tmp_path / "run"

    resumed = train(tmp_path, corpus, "run", 4, *extra)
    assert resumed.returncode == 0, resumed.stderr
    assert "snapshot of step 8 is incomplete: slices [1]" in resumed.stderr
    (resume,) = events(run_dir, "resume")
    assert resume["step"] == 5
    invalid = events(run_dir, "checkpoint_invalid")
    assert invalid and "slices [1]" in invalid[0]["reason"]


def test_a_memory_checkpoint_restores_at_another_world_size_in_the_same_data_order(tmp_path,
                                                                                   corpus):
    extra = ("checkpoint.mode=memory", "checkpoint.interval=5", "train.global_batch_size=16")
    first = train(tmp_path, corpus, "run", 4, *extra, "train.max_steps=5")
    assert first.returncode == 0, first.stderr
    second = train(tmp_path, corpus, "run", 2, *extra, "train.max_steps=10")
    assert second.returncode == 0, second.stderr
    (resume,) = events(tmp_path / "run", "resume")
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (5, 4, 2)
    manifest = json.loads((tmp_path / "run" / "checkpoints" / "step-10" / "manifest.json")
                          .read_text())
    assert manifest["train_state"]["data_position"] == 10 * 16
    assert sorted(n for n in manifest["files"] if n.startswith("part-")) == [
        "part-s0-r0.bin", "part-s1-r1.bin"]  # resharded: two slices now

    ref = train(tmp_path, corpus, "ref", 2, *extra, "train.max_steps=10")
    assert ref.returncode == 0, ref.stderr
    got = {m["step"]: m["loss"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    want = {m["step"]: m["loss"] for m in read_jsonl(tmp_path / "ref" / "metrics.jsonl")}
    for step in range(1, 11):
        assert got[step] == pytest.approx(want[step], rel=2e-5), step


def test_a_rank_killed_inside_an_exchange_leaves_the_previous_snapshot_never_the_partial_one(
        tmp_path, corpus):
    # World size 2: rank 1 dies in the background exchange of step 12 before sending its
    # slice, so rank 0's snapshot of step 12 never got its replica. Rank 0 alone must write
    # steps 11 and 10, whose exchanges finished, and the run must resume from step 11.
    extra = (*MEMORY, "train.global_batch_size=8")
    ref = train(tmp_path, corpus, "ref", 2, *extra)
    assert ref.returncode == 0, ref.stderr

    env = {**kill("1", 12), "PYRECOVER_KILL_POINT": "exchange"}
    crashed = train(tmp_path, corpus, "run", 2, *extra, env=env)
    run_dir = tmp_path / "run"
    assert crashed.returncode != 0
    assert "Traceback" not in crashed.stderr
    (persisted,) = events(run_dir, "snapshot_persisted")
    assert persisted["rank"] == 0 and sorted(persisted["steps"]) == [10, 11]
    assert not (run_dir / "checkpoints" / ".snap-step-12").exists()

    resumed = train(tmp_path, corpus, "run", 2, *extra)
    assert resumed.returncode == 0, resumed.stderr
    (resume,) = events(run_dir, "resume")
    assert resume["step"] == 11
    ref_model, model = export(tmp_path / "ref"), export(run_dir)
    for key in ref_model:
        assert torch.equal(ref_model[key], model[key]), key


def test_memory_mode_at_world_size_1_and_with_one_replica_still_checkpoints_and_resumes(
        tmp_path, corpus):
    # No exchange group at world size 1; no replica, only the RNG gather, with replicas=1.
    for nproc, replicas in ((1, 2), (2, 1)):
        extra = ("checkpoint.mode=memory", "checkpoint.snapshot_interval=1",
                 f"checkpoint.replicas={replicas}", "checkpoint.interval=4", "train.max_steps=8")
        name, ref_name = f"run{nproc}-{replicas}", f"ref{nproc}-{replicas}"
        ref = train(tmp_path, corpus, ref_name, nproc, *extra)
        assert ref.returncode == 0, ref.stderr
        killed = train(tmp_path, corpus, name, nproc, *extra, env={"PYRECOVER_KILL_AT_STEP": "6"})
        assert killed.returncode != 0
        resumed = train(tmp_path, corpus, name, nproc, *extra)
        assert resumed.returncode == 0, resumed.stderr
        (resume,) = events(tmp_path / name, "resume")
        assert resume["step"] == 4
        ref_model, model = export(tmp_path / ref_name), export(tmp_path / name)
        for key in ref_model:
            assert torch.equal(ref_model[key], model[key]), (name, key)


def same(a, b, where: str = "") -> None:
    """same asserts two nested states are equal, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for key in a:
            same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, where


def test_a_memory_checkpoint_converts_to_what_a_vanilla_run_writes(tmp_path, corpus):
    """`ckpt convert` of a memory-mode checkpoint (world size 2, its slices in two ranks'
    files) gives the vanilla file of the same run: weights, optimizer, schedule, train state
    and every rank's generators."""
    extra = ("checkpoint.interval=10", "train.max_steps=10")
    for mode in ("memory", "vanilla"):
        done = train(tmp_path, corpus, mode, 2, f"checkpoint.mode={mode}", *extra)
        assert done.returncode == 0, done.stderr
    out = tmp_path / "from-memory.pt"
    done = pyrecover("ckpt", "convert", str(tmp_path / "memory"), "--to", "torch", str(out))
    assert done.returncode == 0, done.stderr
    assert "converted step 10" in done.stdout and "invalid" not in done.stderr
    got = torch.load(out, weights_only=True)
    want = torch.load(tmp_path / "vanilla" / "checkpoints" / "step-10" / "state.pt",
                      weights_only=True)
    assert len(want["rng"]) == 2
    for key in ("model", "optimizer", "scheduler", "train", "rng"):
        same(got[key], want[key], key)
