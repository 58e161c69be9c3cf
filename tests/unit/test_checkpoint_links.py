"""What the checkpoints folder holds is read off the disk itself (checkpoint/entries.py): a
symbolic link in it is never walked into by a clean-up, and storage that fails to answer is
never taken for a checkpoint that is not there."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pyrecover.checkpoint import entries, resume, retention, store
from pyrecover.checkpoint.memory import finalize_snapshots


def commit(root: Path, step: int) -> Path:
    pending = store.begin(root, step)
    with pending.open("state.pt") as f:
        f.write(bytes(range(256)) * 4)
    return pending.commit("vanilla", 1, {"step": step})


def precious(folder: Path) -> Path:
    """Another run's checkpoint, which a link in this run's checkpoints points at."""
    folder.mkdir(parents=True)
    (folder / "state.pt").write_bytes(b"weights of another run")
    (folder / store.MANIFEST).write_text("{}")
    return folder


def test_a_linked_step_folder_is_never_retired_so_its_target_keeps_its_files(tmp_path):
    """A user linked another run's step-5 in. Retention counted it and renamed the link to
    .old-step-5-*; the next start's clean-up then walked the link and emptied the target."""
    root = tmp_path / "run" / "checkpoints"
    other = precious(tmp_path / "other" / "checkpoints" / "step-5")
    for step in (10, 20):
        commit(root, step)
    (root / "step-5").symlink_to(other, target_is_directory=True)
    kept = retention.Retention(root, keep=3)
    commit(root, 30)
    kept.after_commit(30)
    kept.wait()
    resume.tidy(root, lambda *a, **k: None)  # what the next start does first
    assert sorted(p.name for p in root.iterdir()) == ["step-10", "step-20", "step-30", "step-5"]
    assert sorted(p.name for p in other.iterdir()) == [store.MANIFEST, "state.pt"]
    # The link takes no place of a real checkpoint: keep=3 keeps three that load.
    commit(root, 40)
    kept.after_commit(40)
    kept.wait()
    assert [s for s, *_ in store.scan(root) if _[1] is not None] == [40, 30, 20]


@pytest.mark.parametrize("name", [".old-step-5-abcd1234", ".tmp-step-40-0011aabb"])
def test_a_leftover_name_that_is_a_link_loses_the_link_only(tmp_path, name):
    root = tmp_path / "checkpoints"
    root.mkdir()
    other = precious(tmp_path / "other")
    (root / name).symlink_to(other, target_is_directory=True)
    assert entries.clean_uncommitted(root) == [root / name]
    assert list(root.iterdir()) == []
    assert sorted(p.name for p in other.iterdir()) == [store.MANIFEST, "state.pt"]


def test_a_linked_survivors_snapshot_is_dropped_without_writing_into_its_target(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    other = precious(tmp_path / "other")
    (root / ".snap-step-7").symlink_to(other, target_is_directory=True)
    (root / ".snap-step-notes").mkdir()  # no step number: not a snapshot, and no crash
    finalize_snapshots(root, lambda *a, **k: None)
    assert sorted(p.name for p in root.iterdir()) == [".snap-step-notes"]
    assert sorted(p.name for p in other.iterdir()) == [store.MANIFEST, "state.pt"]


def test_storage_failing_on_a_manifest_never_passes_for_a_save_that_did_not_commit(
        tmp_path, monkeypatch):
    """EIO from stat(manifest.json): the start must refuse (exit 1, requeued), not resume
    from step 0 beside the real checkpoints. pathlib's is_file() answers False for any
    OSError from Python 3.13 on; it is made to here, whatever Python runs the test."""
    root = tmp_path / "checkpoints"
    for step in (10, 20):
        commit(root, step)
    monkeypatch.setattr(Path, "is_file", lambda self, **_: os.path.isfile(self))
    monkeypatch.setattr(Path, "is_dir", lambda self, **_: os.path.isdir(self))
    monkeypatch.setattr(Path, "is_symlink", lambda self: os.path.islink(self))
    real_lstat, real_stat = os.lstat, os.stat

    def failing(real):
        def call(path, *args, **kwargs):
            if str(path).endswith(store.MANIFEST):
                raise OSError(5, "Input/output error", str(path))
            return real(path, *args, **kwargs)
        return call
    monkeypatch.setattr(os, "lstat", failing(real_lstat))
    monkeypatch.setattr(os, "stat", failing(real_stat))
    choice = resume.pick(root, None, {})
    assert choice.found is None
    assert [step for step, *_ in choice.invalid] == [20, 10]
    assert all("Input/output error" in why for *_, why in choice.invalid), choice.invalid
    assert choice.refusal() is not None
