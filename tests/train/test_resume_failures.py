"""A resume that cannot use the newest checkpoints never costs the run the ones it has.

Real `pyrecover train` runs (vanilla, keep=2) leave step-20 and step-30; each test copies
them, breaks what it names, and starts the run again:

- checkpoints that verify but none restores (here a train state the loop refuses; in life a
  transient EIO, an OOM, a format change): exit 1, which the job script requeues, every
  checkpoint left as it was, and the next start (the fault gone) resumes the newest;
- a resume past a corrupt newest checkpoint: retention counts only what is at or below the
  step it commits, so keep=2 still leaves two loadable checkpoints, and the corrupt one stays;
- only corrupt checkpoints: the run starts over, and its commits retire none of them nor
  themselves;
- a finished run started again: its final checkpoint is not written a second time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import events, pyrecover, tiny_args

from pyrecover.checkpoint import store


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, corpus) -> Path:
    storage = tmp_path_factory.mktemp("finished")
    done = pyrecover("train", *tiny_args(storage, corpus, "run", "checkpoint.keep=2"))
    assert done.returncode == 0, done.stderr
    assert steps(storage / "run") == [30, 20]
    return storage / "run"


@pytest.fixture
def run(tmp_path, finished_run) -> Path:
    shutil.copytree(finished_run, tmp_path / "run", symlinks=True)
    return tmp_path / "run"


def train(run: Path, corpus: Path, *extra: str):
    return pyrecover("train", *tiny_args(run.parent, corpus, run.name, "checkpoint.keep=2",
                                         *extra))


def steps(run: Path) -> list[int]:
    return [s for s, _ in store.committed_steps(run / "checkpoints")]


def folder(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step}"


def flip_a_byte(run: Path, step: int) -> None:
    path = folder(run, step) / "state.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def another_shape(run: Path, step: int) -> tuple[bytes, str]:
    """another_shape gives the model in step's file another shape (as a changed model or
    format would) with a manifest to match, so the checkpoint verifies and cannot be restored;
    returns the file and manifest it had."""
    path, mpath = folder(run, step) / "state.pt", folder(run, step) / "manifest.json"
    before = path.read_bytes(), mpath.read_text()
    state = torch.load(path, weights_only=True)
    name = next(iter(state["model"]))
    state["model"][name] = state["model"][name][:1]
    torch.save(state, path)
    manifest = json.loads(before[1])
    manifest["files"]["state.pt"] = {"size": path.stat().st_size,
                                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    mpath.write_text(json.dumps(manifest))
    return before


def test_checkpoints_that_verify_but_none_restores_exit_1_and_are_all_kept(run, corpus):
    saved = {step: another_shape(run, step) for step in (20, 30)}
    done = train(run, corpus)
    assert done.returncode == 1, done.stderr  # a crash: requeued, the fault may pass
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert f"{folder(run, 30)}" in errors[0] and "size mismatch" in errors[0], errors
    assert steps(run) == [30, 20]
    assert not [p for p in (run / "checkpoints").iterdir() if not p.name.startswith("step-")]
    assert len(events(run, "start")) == 1 and events(run, "crash")  # the first run's only
    assert [e["step"] for e in events(run, "checkpoint")] == [10, 20, 30]  # nothing new

    for step, (data, manifest) in saved.items():  # the fault passed: the next start resumes
        (folder(run, step) / "state.pt").write_bytes(data)
        (folder(run, step) / "manifest.json").write_text(manifest)
    again = train(run, corpus)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {folder(run, 30)}" in again.stderr


def test_a_resume_past_a_corrupt_newest_keeps_two_loadable_checkpoints(run, corpus):
    flip_a_byte(run, 30)
    done = train(run, corpus, "train.max_steps=25")
    assert done.returncode == 0, done.stderr
    assert f"resumed from {folder(run, 20)}" in done.stderr
    assert steps(run) == [30, 25, 20]  # keep=2 of what loads; the corrupt one kept aside
    for step in (25, 20):
        store.verify(folder(run, step))


def test_a_run_whose_checkpoints_are_all_corrupt_starts_over_and_deletes_nothing(run, corpus):
    flip_a_byte(run, 20)
    flip_a_byte(run, 30)
    done = train(run, corpus, "train.max_steps=10")
    assert done.returncode == 0, done.stderr
    assert [e["step"] for e in events(run, "start")] == [0, 0]
    assert steps(run) == [30, 20, 10]  # its own commit too: retention retired nothing
    store.verify(folder(run, 10))


def test_a_finished_run_started_again_does_not_write_its_final_checkpoint_again(run, corpus):
    before = (folder(run, 30) / "manifest.json").stat().st_ino
    done = train(run, corpus)
    assert done.returncode == 0, done.stderr
    assert "nothing to do" in done.stderr
    assert [e["step"] for e in events(run, "checkpoint")] == [10, 20, 30]
    assert (folder(run, 30) / "manifest.json").stat().st_ino == before
    assert steps(run) == [30, 20]


def reseal(run: Path, step: int, name: str) -> None:
    """reseal gives `name` of step's checkpoint the manifest entry of what it holds now, as a
    writer that saved the wrong thing would have."""
    path, mpath = folder(run, step) / name, folder(run, step) / "manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["files"][name] = {"size": path.stat().st_size,
                               "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    mpath.write_text(json.dumps(manifest))


def test_a_newest_checkpoint_whose_rng_record_is_malformed_is_passed_over_for_the_one_before(
        run, corpus):
    # It verified, and every resume died with a traceback (KeyError: 'python') once it was
    # chosen: exit 1, requeued, again and again.
    path = folder(run, 30) / "state.pt"
    state = torch.load(path, weights_only=True)
    state["rng"] = [{"junk": torch.zeros(3)}] * len(state["rng"])
    torch.save(state, path)
    reseal(run, 30, "state.pt")
    listed = pyrecover("ckpt", "ls", str(run))
    assert "INVALID: cannot be read: ValueError: its RNG state is not a record" in \
        listed.stdout, listed.stdout
    done = train(run, corpus, "train.max_steps=35")
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert f"resumed from {folder(run, 20)}" in done.stderr
    assert f"{folder(run, 30)}" in done.stderr and "RNG state" in done.stderr
