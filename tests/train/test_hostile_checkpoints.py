"""Checkpoints written by someone hostile (or by a broken tool): never run code, never crash a
resume, never read outside their folder. Each test tampers with the newest checkpoint of a
real DCP run, fixes up its manifest as an attacker could, and resumes: the tampered one is
reported by name as invalid and the previous one is used."""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from helpers import pyrecover, tiny_args

from pyrecover.checkpoint.tools import temporary
from pyrecover.rundir import StorageError, read_jsonl


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus) -> tuple[Path, Path]:
    """A DCP run with checkpoints at steps 10 and 20 (copied by each test)."""
    storage = tmp_path_factory.mktemp("hostile")
    done = pyrecover("train", *tiny_args(storage, corpus, "run", "checkpoint.mode=dcp",
                                         "train.max_steps=20"))
    assert done.returncode == 0, done.stderr
    return storage / "run", corpus


@pytest.fixture
def run(tmp_path, finished_run) -> Path:
    src, _ = finished_run
    shutil.copytree(src, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def resume(run: Path, corpus: Path):
    # max_steps=10: the fallback to step 10 has nothing left to train, so the test is quick.
    return pyrecover("train", *tiny_args(run.parent, corpus, run.name, "checkpoint.mode=dcp",
                                         "train.max_steps=10"))


def rewrite_manifest(folder: Path, change) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def replace_file(folder: Path, name: str, data: bytes) -> None:
    """replace_file swaps a file and fixes its size and checksum in the manifest."""
    (folder / name).write_bytes(data)
    rewrite_manifest(folder, lambda m: m["files"].__setitem__(
        name, {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def assert_fell_back(done, run: Path, invalid: str) -> None:
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines()
             if "skipping checkpoint step 20: invalid: " in line]
    assert len(lines) == 1 and invalid in lines[0], done.stderr
    assert f"resumed from {run / 'checkpoints' / 'step-10'}" in done.stderr
    events = read_jsonl(run / "events.jsonl")
    assert any(e["event"] == "checkpoint_invalid" and e["step"] == 20 for e in events)


def test_a_metadata_pickle_that_runs_code_is_refused_by_resume_and_export(run, finished_run,
                                                                           tmp_path):
    _, corpus = finished_run
    marker = tmp_path / "PWNED"
    newest = run / "checkpoints" / "step-20"
    replace_file(newest, ".metadata", pickle.dumps(RunsCode(marker)))

    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode == 1
    assert "step 20: INVALID:" in verified.stdout and "posix.system" in verified.stdout
    exported = pyrecover("ckpt", "export", str(run), "--out", str(tmp_path / "w.pt"))
    assert exported.returncode == 0, exported.stderr
    assert "checkpoint step 20 is invalid" in exported.stderr
    assert "exported step 10" in exported.stdout
    only = pyrecover("ckpt", "export", str(run), "--step", "20", "--out", str(tmp_path / "x.pt"))
    assert only.returncode == 2 and only.stderr.count("\n") == 1, only.stderr
    converted = pyrecover("ckpt", "convert", str(run), "--to", "torch", "c.pt", cwd=tmp_path)
    assert converted.returncode == 0 and "converted step 10" in converted.stdout
    assert converted.stdout.rstrip().endswith(f": {tmp_path / 'c.pt'}")  # whole, as export
    listed = pyrecover("ckpt", "ls", str(run))
    assert [line for line in listed.stdout.splitlines() if "INVALID" in line][0].split()[0] == "20"
    assert_fell_back(resume(run, corpus), run, "posix.system")
    assert not marker.exists()


@pytest.mark.parametrize("change, problem", [
    (lambda m: m["files"][".metadata"].pop("size"), "has no size"),
    (lambda m: m.__setitem__("files", list(m["files"])), "'files' is not an object"),
    (lambda m: m["files"].__setitem__(".metadata", "x"), "is not an object"),
    (lambda m: m.__setitem__("files", {}), "at least one file"),
    (lambda m: m.__setitem__("step", 99), "'step' is 99, but the folder is step-20"),
    (lambda m: m["files"].__setitem__("../../../../etc/passwd", {"size": 1, "sha256": "0"}),
     "not a plain file name"),
    (lambda m: m["files"].__setitem__("/etc/passwd", {"size": 1, "sha256": "0"}),
     "not a plain file name"),
    (lambda m: m.__setitem__("mode", "vanilla"), "mode 'vanilla', but the manifest lists no "
     "state.pt"),
])
def test_a_broken_manifest_is_named_invalid_and_the_previous_checkpoint_resumes(
        run, finished_run, change, problem):
    _, corpus = finished_run
    rewrite_manifest(run / "checkpoints" / "step-20", change)
    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode == 1 and "Traceback" not in verified.stderr
    assert "step 20: INVALID: " in verified.stdout and problem in verified.stdout
    status = pyrecover("status", str(run))
    assert status.returncode == 0 and "Traceback" not in status.stderr
    invalid = [line for line in status.stdout.splitlines() if line.startswith("invalid ")]
    assert len(invalid) == 1 and "checkpoint step 20: " in invalid[0], status.stdout
    assert_fell_back(resume(run, corpus), run, problem)


def test_a_train_state_that_does_not_fit_is_skipped(run, finished_run):
    _, corpus = finished_run
    rewrite_manifest(run / "checkpoints" / "step-20",
                     lambda m: m.__setitem__("train_state", {"step": "x", "nonsense": 1}))
    assert_fell_back(resume(run, corpus), run, "cannot be restored")


@pytest.mark.parametrize("saved", [{"step": 20, "nonsense": 1}, {"step": -1},
                                   {"step": 20, "data_position": "x"}])
def test_ckpt_verify_refuses_a_train_state_the_resume_cannot_restore(run, saved):
    """`ckpt verify` said "step 20: ok" and exit 0 of a DCP checkpoint whose manifest's train
    state the resume then refused ("cannot be restored"): ls and verify told the user that
    the checkpoint a requeue would skip was good."""
    rewrite_manifest(run / "checkpoints" / "step-20",
                     lambda m: m.__setitem__("train_state", saved))
    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
    assert verified.stdout.startswith("step 20: INVALID: "), verified.stdout
    assert "train state" in verified.stdout, verified.stdout


def test_the_checkpoint_code_knows_the_loop_s_train_state_fields():
    from dataclasses import fields

    from pyrecover.checkpoint.mode import TRAIN_STATE_KEYS
    from pyrecover.loop import TrainState

    assert set(TRAIN_STATE_KEYS) == {f.name for f in fields(TrainState)}


def test_a_symlinked_checkpoint_file_is_refused(run, finished_run):
    _, corpus = finished_run
    newest = run / "checkpoints" / "step-20"
    extra = newest / "extra.json"
    target = run.parent / "elsewhere.json"
    shutil.move(extra, target)
    extra.symlink_to(target)
    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode == 1 and "not a regular file" in verified.stdout
    assert_fell_back(resume(run, corpus), run, "not a regular file")


def test_a_checkpoint_of_another_model_shape_is_skipped(run, finished_run, tmp_path):
    _, corpus = finished_run
    other = pyrecover("train", *tiny_args(tmp_path / "o", corpus, "other", "checkpoint.mode=dcp",
                                          "train.max_steps=10", "model.n_embd=32"))
    assert other.returncode == 0, other.stderr
    shutil.rmtree(run / "checkpoints" / "step-20")
    shutil.copytree(tmp_path / "o" / "other" / "checkpoints" / "step-10",
                    run / "checkpoints" / "step-20")
    rewrite_manifest(run / "checkpoints" / "step-20", lambda m: m.__setitem__("step", 20))
    # ckpt verify and ls say so before a resume finds out (their files verify).
    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode == 1, verified.stdout
    assert verified.stdout.splitlines() == [
        "step 20: INVALID: made for another model (model.n_embd 32, run.yaml 64): this run "
        "cannot restore it", "step 10: ok"]
    assert_fell_back(resume(run, corpus), run, "cannot be restored")


def test_an_export_over_a_folder_or_whose_rename_fails_is_one_line_and_leaves_nothing(
        run, tmp_path):
    out = tmp_path / "out"
    (out / "occupied").mkdir(parents=True)  # a non-empty folder: a rename cannot replace it
    done = pyrecover("ckpt", "export", str(run), "--out", str(out))
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "is a folder; --format torch writes a file" in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    # The folder appearing after that check: the rename fails, one line, no temporary left.
    with pytest.raises(StorageError, match="storage: cannot write .*/out: "):
        with temporary(out) as tmp:
            tmp.write_bytes(b"weights")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]
    assert [p.name for p in out.iterdir()] == ["occupied"]


def test_a_checkpoint_the_resume_went_back_past_is_kept_for_inspection(run, finished_run):
    _, corpus = finished_run
    newest = run / "checkpoints" / "step-20"
    (newest / "extra.json").write_text("{}")  # wrong size: invalid
    done = pyrecover("train", *tiny_args(run.parent, corpus, run.name, "checkpoint.mode=dcp",
                                         "train.max_steps=20"))
    assert done.returncode == 0, done.stderr
    kept = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("invalid-step-20-")]
    assert len(kept) == 1 and (kept[0] / "extra.json").read_text() == "{}"
    assert pyrecover("ckpt", "verify", str(run)).returncode == 0  # the redone step 20 verifies


def test_an_rng_file_the_weights_only_unpickler_refuses_is_skipped(run, finished_run, tmp_path):
    _, corpus = finished_run
    marker = tmp_path / "PWNED"
    replace_file(run / "checkpoints" / "step-20", "rng-0.pt", pickle.dumps(RunsCode(marker)))
    assert_fell_back(resume(run, corpus), run, "cannot be restored")
    assert not marker.exists()


def test_an_rng_record_of_other_keys_is_skipped_and_named_before_a_resume(run, finished_run):
    # It verified, and every resume died with a traceback (KeyError: 'python') once it was
    # chosen: exit 1, requeued, again and again.
    _, corpus = finished_run
    data = io.BytesIO()
    torch.save({"junk": torch.zeros(3)}, data)
    replace_file(run / "checkpoints" / "step-20", "rng-0.pt", data.getvalue())
    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode != 0 and "RNG state" in verified.stdout + verified.stderr
    assert_fell_back(resume(run, corpus), run, "its RNG state (rank 0) is not a record")


def test_a_missing_rng_file_fails_verify_as_it_fails_convert(run, finished_run):
    (run / "checkpoints" / "step-20" / "rng-0.pt").unlink()
    rewrite_manifest(run / "checkpoints" / "step-20", lambda m: m["files"].pop("rng-0.pt"))
    verified = pyrecover("ckpt", "verify", str(run))
    assert verified.returncode != 0, verified.stdout
    assert "no rng-0.pt in" in verified.stdout + verified.stderr
