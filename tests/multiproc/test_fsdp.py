"""`train.parallel: fsdp` (FSDP2 over gloo): it trains, a SIGKILLed run resumes bit for bit,
checkpoints move between ddp and fsdp and between world sizes in the same data order, and no
rank ever holds more than its own shard of the optimizer state.

Real `pyrecover train --nproc N` runs, the kill a real SIGKILL (pyrecover/faults.py).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import events, load_export, pyrecover, tiny_args

from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc

FSDP = "train.parallel=fsdp"


def train(storage: Path, corpus: Path, name: str, nproc: int, *extra: str, env=None):
    return pyrecover("train", "--nproc", str(nproc), *tiny_args(storage, corpus, name, *extra),
                     env=env)


def kill_at(step: int) -> dict[str, str]:
    """A kill after step `step`, once the background save in flight (dcp) has committed: the
    tests expect the checkpoint of step 10 however busy the machine (faults.py)."""
    return {"PYRECOVER_KILL_AT_STEP": str(step), "PYRECOVER_KILL_AFTER_COMMIT": "1"}


def export(run_dir: Path) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    done = pyrecover("ckpt", "export", str(run_dir), "--out", str(out))
    assert done.returncode == 0, done.stderr
    return load_export(out)


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def resumed_at(run_dir: Path) -> list[int]:
    return [e["step"] for e in events(run_dir, "resume")]


def assert_same_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs"


def assert_close_model(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    """Another reduction layout (ddp vs fsdp, 4 vs 2 ranks) sums in another order: the last
    bits differ, nothing more (measured: at most 1.2e-7 after 30 steps of the tiny model)."""
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5, msg=key)


def assert_same_batches(run: dict[int, float], ref: dict[int, float], after: int) -> None:
    """The same windows in every global batch after the resume: another batch would change
    the loss in the second decimal, another summation order only in the sixth digit."""
    steps = [s for s in ref if s > after]
    assert steps and all(s in run for s in steps)
    for s in steps:
        assert run[s] == pytest.approx(ref[s], rel=1e-5), f"step {s}"


@pytest.fixture(scope="module")
def fsdp_ref(tmp_path_factory, corpus):
    """30 fsdp steps at world size 2 without interruption (dcp checkpoints), exported."""
    storage = tmp_path_factory.mktemp("fsdp_ref")
    done = train(storage, corpus, "ref", 2, FSDP, "checkpoint.mode=dcp")
    assert done.returncode == 0, done.stderr
    assert [e["parallel"] for e in events(storage / "ref", "start")] == ["fsdp"]
    return storage / "ref", export(storage / "ref")


@pytest.mark.parametrize("mode, kill", [("dcp", 18), ("vanilla", 15)])
def test_an_fsdp_run_killed_between_checkpoints_resumes_bit_for_bit(tmp_path, corpus, fsdp_ref,
                                                                    mode, kill):
    ref_dir, ref_model = fsdp_ref
    extra = (FSDP, f"checkpoint.mode={mode}")
    killed = train(tmp_path, corpus, "run", 2, *extra, env=kill_at(kill))
    assert killed.returncode == -9, killed.stderr
    resumed = train(tmp_path, corpus, "run", 2, *extra)
    assert resumed.returncode == 0, resumed.stderr
    run_dir = tmp_path / "run"
    assert resumed_at(run_dir) == [10]
    run, ref = losses(run_dir), losses(ref_dir)
    assert [run[s] for s in range(11, 31)] == [ref[s] for s in range(11, 31)]
    # The vanilla file (gathered on rank 0) and DCP's shards hold the same model.
    assert_same_model(export(run_dir), ref_model)


@pytest.mark.parametrize("saved, resumed", [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_a_checkpoint_moves_between_ddp_and_fsdp_in_the_same_data_order(tmp_path, corpus,
                                                                        fsdp_ref, saved, resumed):
    ref_dir, ref_model = fsdp_ref
    killed = train(tmp_path, corpus, "run", 2, f"train.parallel={saved}", "checkpoint.mode=dcp",
                   env=kill_at(13))
    assert killed.returncode == -9, killed.stderr
    done = train(tmp_path, corpus, "run", 2, f"train.parallel={resumed}", "checkpoint.mode=dcp")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "run"
    assert resumed_at(run_dir) == [10]
    assert [e["parallel"] for e in events(run_dir, "resume")] == [resumed]
    assert_same_batches(losses(run_dir), losses(ref_dir), after=10)
    assert_close_model(export(run_dir), ref_model)


def test_at_world_size_4_fsdp_resumes_bit_for_bit_reshards_to_2_and_shards_its_state(tmp_path,
                                                                                     corpus):
    extra = (FSDP, "checkpoint.mode=dcp", "train.max_steps=20")
    ref = train(tmp_path, corpus, "ref", 4, *extra)
    assert ref.returncode == 0, ref.stderr
    killed = train(tmp_path, corpus, "run", 4, *extra, env=kill_at(16))
    assert killed.returncode == -9, killed.stderr
    shutil.copytree(tmp_path / "run", tmp_path / "at2")

    again = train(tmp_path, corpus, "run", 4, *extra)
    assert again.returncode == 0, again.stderr
    assert resumed_at(tmp_path / "run") == [10]
    ref_model = export(tmp_path / "ref")
    assert_same_model(export(tmp_path / "run"), ref_model)

    # The same checkpoint, written as 4 ranks' shards, continued by 2 ranks (DCP reshards).
    smaller = pyrecover("train", "--nproc", "2", *tiny_args(tmp_path, corpus, "at2", *extra))
    assert smaller.returncode == 0, smaller.stderr
    (event,) = events(tmp_path / "at2", "resume")
    assert (event["step"], event["saved_world_size"], event["world_size"]) == (10, 4, 2)
    assert_same_batches(losses(tmp_path / "at2"), losses(tmp_path / "ref"), after=10)
    assert_close_model(export(tmp_path / "at2"), ref_model)

    assert_each_rank_wrote_only_its_shards(tmp_path / "ref" / "checkpoints" / "step-20", 4)
    # The tools read the shards back whole: `ckpt convert` to one torch file.
    out = tmp_path / "whole.pt"
    done = pyrecover("ckpt", "convert", str(tmp_path / "ref"), "--to", "torch", str(out))
    assert done.returncode == 0, done.stderr
    whole = torch.load(out, weights_only=True)
    assert whole["model"].keys() == ref_model.keys()
    first = whole["optimizer"]["state"][0]["exp_avg"]  # the embedding's, all its rows
    assert first.shape == ref_model["wte.weight"].shape


def assert_each_rank_wrote_only_its_shards(folder: Path, world: int) -> None:
    """No rank holds the whole optimizer state: each rank's DCP files hold what it had, and
    every AdamW moment with a row per rank or more was written as one chunk per rank, each
    at most 1/N of its rows (a DDP save writes each whole, by one rank)."""
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(folder)).read_metadata()
    moments = {k: v for k, v in meta.state_dict_metadata.items()
               if k.startswith("optim.state.") and k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(moments) >= 2 * 10  # every parameter's two AdamW moments
    writers = set()
    for key, tensor in moments.items():
        rows = tensor.size[0]
        assert len(tensor.chunks) == min(world, rows), key
        for chunk in tensor.chunks:
            assert chunk.sizes[0] <= -(-rows // world) < rows, key
        writers |= {meta.storage_data[i].relative_path.split("_")[2]
                    for i in meta.storage_data if i.fqn == key}
    assert writers == {str(r) for r in range(world)}  # every rank wrote its own shards


@pytest.mark.parametrize("mode, where", [("vanilla", "onto rank 0"),
                                         ("memory", "onto every rank when it restores")])
def test_a_mode_that_gathers_refuses_a_state_above_the_limit(tmp_path, corpus, mode, where):
    done = train(tmp_path, corpus, "run", 2, FSDP, f"checkpoint.mode={mode}",
                 "checkpoint.gather_max_gb=0.0001")
    assert done.returncode == 2, done.stderr
    assert re.search(rf"checkpoint.mode={mode} would gather 0\.00\d+ GB of model and "
                     rf"optimizer state {where} \(checkpoint.gather_max_gb=0.0001\)",
                     done.stderr), done.stderr
    assert "use checkpoint.mode=dcp" in done.stderr
    assert "Traceback" not in done.stderr


MEMORY = (FSDP, "checkpoint.mode=memory", "checkpoint.snapshot_interval=1",
          "checkpoint.replicas=2", "checkpoint.interval=100", "train.max_steps=16")


def test_memory_mode_snapshots_each_ranks_shards_and_a_killed_rank_resumes_bit_for_bit(
        tmp_path, corpus):
    """With fsdp, rank r's slice is all of its own shards; its replica is on the next rank.
    One rank SIGKILLed: the survivors persist what they hold (rank 2's shards from rank 3's
    replica), the restart restores them bit for bit, and the same checkpoint also continues
    under ddp at world size 2 (the shards put together into whole tensors)."""
    ref = train(tmp_path, corpus, "ref", 4, *MEMORY)
    assert ref.returncode == 0, ref.stderr
    kill_rank = {"PYRECOVER_KILL_AT_STEP": "12", "PYRECOVER_KILL_RANK": "2",
                 "PYRECOVER_KILL_TARGET": "self"}
    crashed = train(tmp_path, corpus, "run", 4, *MEMORY, env=kill_rank)
    run_dir = tmp_path / "run"
    assert crashed.returncode != 0 and "Traceback" not in crashed.stderr
    assert sorted(e["rank"] for e in events(run_dir, "snapshot_persisted")) == [0, 1, 3]
    shutil.copytree(run_dir, tmp_path / "ddp2")

    resumed = train(tmp_path, corpus, "run", 4, *MEMORY)
    assert resumed.returncode == 0, resumed.stderr
    (resume,) = events(run_dir, "resume")
    assert resume["step"] in (11, 12)
    assert events(run_dir, "snapshot_recovered")[0]["step"] == resume["step"]
    ref_model = export(tmp_path / "ref")
    assert_same_model(export(run_dir), ref_model)
    folder = run_dir / "checkpoints" / f"step-{resume['step']}"
    sizes = {p.name: p.stat().st_size for p in folder.glob("part-s*.bin")}
    assert len({n.split("-")[1] for n in sizes}) == 4  # one slice per rank: its own shards
    assert max(sizes.values()) < 0.5 * sum(sizes.values())  # none holds most of the state

    ddp = train(tmp_path, corpus, "ddp2", 2, *MEMORY, "train.parallel=ddp")
    assert ddp.returncode == 0, ddp.stderr
    (moved,) = events(tmp_path / "ddp2", "resume")
    assert (moved["saved_world_size"], moved["world_size"], moved["parallel"]) == (4, 2, "ddp")
    assert_same_batches(losses(tmp_path / "ddp2"), losses(tmp_path / "ref"), after=moved["step"])
    assert_close_model(export(tmp_path / "ddp2"), ref_model)


def test_an_fsdp_vanilla_file_keeps_the_head_tied_to_the_embedding_as_ddp_writes_it(tmp_path,
                                                                                    corpus):
    """The gathered state ties the head to the token embedding as DDP's state_dict does: one
    tensor in the file, not two copies of the largest weight (a GPT-2's is 154 MB)."""
    extra = ("checkpoint.mode=vanilla", "train.max_steps=10")
    for parallel in ("ddp", "fsdp"):
        done = train(tmp_path, corpus, parallel, 2, f"train.parallel={parallel}", *extra)
        assert done.returncode == 0, done.stderr
    files = {p: tmp_path / p / "checkpoints" / "step-10" / "state.pt" for p in ("ddp", "fsdp")}
    for parallel, path in files.items():
        model = torch.load(path, weights_only=True)["model"]
        assert model["head.weight"].untyped_storage().data_ptr() == \
            model["wte.weight"].untyped_storage().data_ptr(), parallel
    assert files["fsdp"].stat().st_size == pytest.approx(files["ddp"].stat().st_size, rel=0.01)
