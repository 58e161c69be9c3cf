"""DCP mode: sharded background saves that survive a kill mid-write and reshard on load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import events, load_export, pyrecover, tiny_args

from pyrecover.model import GPT, GPTConfig
from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc

# 24 sequences split over 1, 2, 3 or 4 ranks with micro-batches of 2.
RESHARD = ("train.global_batch_size=24", "checkpoint.mode=dcp", "checkpoint.interval=5")


def train(storage: Path, corpus: Path, name: str, nproc: int, *extra: str, env=None):
    return pyrecover("train", "--nproc", str(nproc), *tiny_args(storage, corpus, name, *extra),
                     env=env)


def losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in read_jsonl(run_dir / "metrics.jsonl")}


def test_every_rank_writes_a_share_of_the_checkpoint(tmp_path, corpus):
    done = train(tmp_path, corpus, "run", 2, "checkpoint.mode=dcp", "train.max_steps=10")
    assert done.returncode == 0, done.stderr
    folder = tmp_path / "run" / "checkpoints" / "step-10"
    manifest = json.loads((folder / "manifest.json").read_text())
    sizes = {r: manifest["files"][f"__{r}_0.distcp"]["size"] for r in (0, 1)}
    assert min(sizes.values()) > 0.3 * sum(sizes.values()), sizes  # balanced by bytes
    assert manifest["mode"] == "dcp" and manifest["world_size"] == 2


def test_plain_torch_dcp_loads_the_weights_without_pyrecovers_loader(tmp_path, corpus):
    done = train(tmp_path, corpus, "run", 2, "checkpoint.mode=dcp", "train.max_steps=10")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "run"
    folder = run_dir / "checkpoints" / "step-10"
    cfg = json.loads((folder / "extra.json").read_text())["config"]["model"]
    fresh = GPT(GPTConfig(**cfg))
    state = {"model": fresh.state_dict()}
    with pytest.warns(UserWarning, match="single process"):  # DCP's note: no process group
        dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    fresh.load_state_dict(state["model"])

    exported = pyrecover("ckpt", "export", str(run_dir), "--out", str(tmp_path / "m.pt"))
    assert exported.returncode == 0, exported.stderr
    for key, value in load_export(tmp_path / "m.pt").items():
        assert torch.equal(fresh.state_dict()[key], value), key


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint(tmp_path, corpus):
    run_dir = tmp_path / "run"
    killed = train(tmp_path, corpus, "run", 2, "checkpoint.mode=dcp",
                   env={"PYRECOVER_KILL_AT_STEP": "20", "PYRECOVER_KILL_POINT": "save"})
    assert killed.returncode == -9, killed.stderr
    assert [e["step"] for e in events(run_dir, "checkpoint")] == [10]
    partial = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert partial, "the kill should have left the step-20 write uncommitted"

    verify = pyrecover("ckpt", "verify", str(run_dir))
    assert verify.returncode == 0 and verify.stdout.split() == ["step", "10:", "ok"]
    # Even moved to where a committed one would be, the partial write is not valid.
    fake = run_dir / "checkpoints" / "step-20"
    partial[0].rename(fake)
    verify = pyrecover("ckpt", "verify", str(run_dir), "--step", "20")
    assert verify.returncode == 1 and "never committed" in verify.stdout
    fake.rename(partial[0])

    resumed = train(tmp_path, corpus, "run", 2, "checkpoint.mode=dcp")
    assert resumed.returncode == 0, resumed.stderr
    assert "removed uncommitted checkpoint folder" in resumed.stderr
    assert events(run_dir, "resume")[0]["step"] == 10
    assert not any(p.name.startswith(".tmp-") for p in (run_dir / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def unbroken_losses(tmp_path_factory, corpus) -> dict[int, float]:
    storage = tmp_path_factory.mktemp("ref")
    ref = train(storage, corpus, "ref", 1, *RESHARD, "train.max_steps=10")
    assert ref.returncode == 0, ref.stderr
    return losses(storage / "ref")


@pytest.mark.parametrize("mode", ["vanilla", "dcp"])
def test_a_final_checkpoint_that_cannot_be_written_fails_the_run_and_keeps_the_last_good_one(
        tmp_path, corpus, mode):
    assert train(tmp_path, corpus, "run", 2, f"checkpoint.mode={mode}", "train.max_steps=10",
                 ).returncode == 0
    # Every checkpoint file (>= 0.8 MB) is larger than the files this run may now write, as
    # on a full disk: the final save fails, is tried once more, the run says so and exits 1.
    full = pyrecover("train", "--nproc", "2", *tiny_args(
        tmp_path, corpus, "run", f"checkpoint.mode={mode}", "train.max_steps=20"),
        max_file_bytes=300_000)
    assert full.returncode == 1, full.stderr
    error = [line for line in full.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1, full.stderr  # every rank's failure, said once, by rank 0
    assert "checkpoint of step 20 could not be written" in error[0], full.stderr
    assert "File too large" in error[0] and "newest valid one is step 10" in error[0]
    assert "Traceback" not in full.stderr
    run_dir = tmp_path / "run"
    assert [e["step"] for e in events(run_dir, "checkpoint_failed")] == [20, 20]
    assert pyrecover("ckpt", "verify", str(run_dir)).returncode == 0  # only step 10 remains

    again = train(tmp_path, corpus, "run", 2, f"checkpoint.mode={mode}", "train.max_steps=20")
    assert again.returncode == 0, again.stderr
    assert events(run_dir, "resume")[-1]["step"] == 10


@pytest.mark.parametrize("before, after", [(4, 2), (2, 1), (1, 3)])
def test_a_checkpoint_reshards_to_another_world_size_and_keeps_the_data_order(
        tmp_path, corpus, unbroken_losses, before, after):
    first = train(tmp_path, corpus, "run", before, *RESHARD, "train.max_steps=5")
    assert first.returncode == 0, first.stderr
    second = train(tmp_path, corpus, "run", after, *RESHARD, "train.max_steps=10")
    assert second.returncode == 0, second.stderr
    (resume,) = events(tmp_path / "run", "resume")
    assert (resume["step"], resume["saved_world_size"], resume["world_size"]) == (5, before,
                                                                                   after)
    final = json.loads((tmp_path / "run" / "checkpoints" / "step-10" / "manifest.json")
                       .read_text())["train_state"]
    assert final["data_position"] == 10 * 24  # every window once, none skipped or repeated

    # The same global batches as one unbroken run: losses agree to summation-order noise,
    # where another batch would differ in the second decimal.
    got, want = losses(tmp_path / "run"), unbroken_losses
    for step in range(1, 11):
        assert got[step] == pytest.approx(want[step], rel=2e-5), step


def test_checkpoints_convert_between_the_two_formats_without_losing_a_bit(tmp_path, corpus):
    for mode in ("vanilla", "dcp"):
        done = train(tmp_path, corpus, mode, 1, f"checkpoint.mode={mode}", "train.max_steps=10")
        assert done.returncode == 0, done.stderr
        assert pyrecover("ckpt", "export", str(tmp_path / mode), "--out",
                         str(tmp_path / f"{mode}.pt")).returncode == 0

    # dcp -> one torch file: the same weights, the optimizer's state and the train state.
    out = tmp_path / "from-dcp.pt"
    done = pyrecover("ckpt", "convert", str(tmp_path / "dcp"), "--to", "torch", str(out))
    assert done.returncode == 0, done.stderr
    state = torch.load(out, weights_only=True)
    for key, value in load_export(tmp_path / "dcp.pt").items():
        assert torch.equal(state["model"][key], value), key
    assert state["train"]["step"] == 10
    assert all(float(s["step"]) == 10 for s in state["optimizer"]["state"].values())

    # vanilla -> a dcp folder that plain torch.distributed.checkpoint reads.
    folder = tmp_path / "from-vanilla"
    done = pyrecover("ckpt", "convert", str(tmp_path / "vanilla"), "--to", "dcp", str(folder))
    assert done.returncode == 0, done.stderr
    cfg = json.loads((folder / "extra.json").read_text())["config"]["model"]
    target = {"model": GPT(GPTConfig(**cfg)).state_dict()}
    with pytest.warns(UserWarning, match="single process"):
        dcp.load(target, checkpoint_id=str(folder), no_dist=True)
    for key, value in load_export(tmp_path / "vanilla.pt").items():
        assert torch.equal(target["model"][key], value), key

    again = pyrecover("ckpt", "convert", str(tmp_path / "vanilla"), "--to", "dcp", str(folder),
                      "--force")  # a folder with a checkpoint in it is never replaced
    assert again.returncode == 2 and "not an empty folder" in again.stderr, again.stderr
    assert (folder / "extra.json").exists()
    empty = tmp_path / "made-for-it"  # an empty folder is written into, as export hf does
    empty.mkdir()
    into = pyrecover("ckpt", "convert", str(tmp_path / "vanilla"), "--to", "dcp", str(empty))
    assert into.returncode == 0 and (empty / "extra.json").exists(), into.stderr

    # An existing file is kept unless --force, which replaces it with the converted state.
    out.write_bytes(b"an older state")
    again = pyrecover("ckpt", "convert", str(tmp_path / "dcp"), "--to", "torch", str(out))
    assert again.returncode == 2 and "or --force to replace it" in again.stderr
    assert out.read_bytes() == b"an older state"
    again = pyrecover("ckpt", "convert", str(tmp_path / "dcp"), "--to", "torch", str(out),
                      "--force")
    assert again.returncode == 0, again.stderr
    assert torch.equal(torch.load(out, weights_only=True)["model"]["wte.weight"],
                       state["model"]["wte.weight"])
    inside = tmp_path / "dcp" / "run.yaml"  # the run's own files are never replaced
    before = inside.read_bytes()
    again = pyrecover("ckpt", "convert", str(tmp_path / "dcp"), "--to", "torch", str(inside),
                      "--force")
    assert again.returncode == 2 and "of the run directory" in again.stderr
    assert inside.read_bytes() == before
