"""The commit protocol: a checkpoint exists only once its manifest and every file verify."""

from __future__ import annotations

import json

import pytest

from pyrecover.checkpoint import entries, store
from pyrecover.checkpoint.store import CheckpointError


def commit(root, step, payload=b"x" * 1000):
    pending = store.begin(root, step)
    with pending.open("state.pt") as f:
        f.write(payload)
    return pending.commit("vanilla", 2, {"step": step})


def test_a_committed_checkpoint_verifies_with_sizes_and_checksums(tmp_path):
    folder = commit(tmp_path, 10)
    ckpt = store.verify(folder)
    assert (ckpt.step, ckpt.mode, ckpt.size) == (10, "vanilla", 1000)
    assert folder.name == "step-10"


def test_a_save_killed_before_its_manifest_leaves_no_checkpoint(tmp_path):
    commit(tmp_path, 10)
    pending = store.begin(tmp_path, 20)
    with pending.open("state.pt") as f:
        f.write(b"half")
    # No commit: the process died here.
    assert [s for s, *_ in store.scan(tmp_path)] == [10]
    assert entries.clean_uncommitted(tmp_path) == [pending.tmp]
    assert not pending.tmp.exists()


@pytest.mark.parametrize("damage, problem", [
    (lambda p: p.write_bytes(p.read_bytes()[:500]), "truncated"),
    (lambda p: p.write_bytes(b"y" + p.read_bytes()[1:]), "sha256 does not match"),
    (lambda p: p.unlink(), "missing"),
    (lambda p: (p.parent / "manifest.json").write_text("{"), "not valid JSON"),
    (lambda p: (p.parent / "manifest.json").unlink(), "never committed"),
])
def test_damage_to_the_newest_checkpoint_is_named_and_the_older_one_is_chosen(tmp_path, damage,
                                                                                problem):
    commit(tmp_path, 10)
    newest = commit(tmp_path, 20)
    damage(newest / "state.pt")
    rows = list(store.scan(tmp_path))
    assert [(step, ckpt is not None) for step, _, ckpt, _ in rows] == [(20, False), (10, True)]
    assert problem in rows[0][3]
    with pytest.raises(CheckpointError, match=problem):
        store.verify(newest)


def test_a_size_only_check_misses_a_flipped_byte_but_the_full_check_does_not(tmp_path):
    folder = commit(tmp_path, 10)
    path = folder / "state.pt"
    path.write_bytes(b"y" + path.read_bytes()[1:])
    store.verify(folder, checksums=False)
    with pytest.raises(CheckpointError):
        store.verify(folder)


def test_recommitting_a_step_replaces_it_whole(tmp_path):
    commit(tmp_path, 10, b"old" * 10)
    folder = commit(tmp_path, 10, b"new" * 10)
    assert (folder / "state.pt").read_bytes() == b"new" * 10
    assert [p.name for p in tmp_path.iterdir()] == ["step-10"]


def test_recommitting_over_an_invalid_step_keeps_the_invalid_one_for_inspection(tmp_path):
    old = commit(tmp_path, 10, b"old" * 10)
    (old / "state.pt").write_bytes(b"cut")
    folder = commit(tmp_path, 10, b"new" * 10)
    assert store.verify(folder).size == 30
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("invalid-step-10-")]
    assert len(kept) == 1 and (kept[0] / "state.pt").read_bytes() == b"cut"
    assert [s for s, _ in store.committed_steps(tmp_path)] == [10]


def test_a_folder_named_with_a_digit_int_cannot_read_is_no_step(tmp_path):
    """`step-\u00b2` passes str.isdigit(); taking it for a step made int() raise in every scan
    of the run's checkpoints, and so every start of the run."""
    commit(tmp_path, 10)
    (tmp_path / "step-\u00b2").mkdir()
    assert [s for s, _ in store.committed_steps(tmp_path)] == [10]
    assert [step for step, *_ in store.scan(tmp_path)] == [10]


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/b", "..", ".", "", "manifest.json"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused(tmp_path, name):
    folder = commit(tmp_path, 10)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = {"size": 1, "sha256": "0"}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="not a"):
        store.verify(folder)


def test_a_symlinked_step_folder_is_refused(tmp_path):
    real = commit(tmp_path / "elsewhere", 10)
    (tmp_path / "ckpts").mkdir()
    (tmp_path / "ckpts" / "step-10").symlink_to(real)
    (row,) = list(store.scan(tmp_path / "ckpts"))
    assert row[2] is None and "symbolic link" in row[3]


def test_a_scan_of_some_steps_reads_no_other_checkpoint(tmp_path, monkeypatch):
    # `ckpt verify --step N` checksums step N alone, not every checkpoint of the run.
    for step in (10, 20, 30):
        commit(tmp_path, step)
    read = []
    verify = store.verify
    monkeypatch.setattr(store, "verify", lambda folder, *a, **k: read.append(folder.name)
                        or verify(folder, *a, **k))
    found = [(step, ckpt is not None) for step, _, ckpt, _ in store.scan(tmp_path, steps={20})]
    assert found == [(20, True)] and read == ["step-20"]
