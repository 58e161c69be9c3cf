"""What a start finds of a commit that crashed, and what retention may retire: real vanilla
checkpoints of a small state, written by the real manager into a real run directory."""

from __future__ import annotations

import os

import pytest
import torch

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, resume, store
from pyrecover.rundir import RunDir, read_jsonl

CPU = torch.device("cpu")
BYTES = 200_000


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Outside SLURM every verify reads its checksums (trust.py), wherever the tests run."""
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)


def save(run: RunDir, step: int, seed: int = 0, keep: int = 2) -> None:
    parts = build_state(BYTES, seed=seed).parts
    manager = CheckpointManager(run, "vanilla", 10, keep, 0, 1, parts, CPU, False)
    manager.at_step(step, final=True)
    manager.finish(step)


def steps(run: RunDir) -> list[int]:
    return [s for s, _ in store.committed_steps(run.checkpoints)]


def names(run: RunDir) -> list[str]:
    return sorted(p.name.rsplit("-", 1)[0] if p.name.startswith(".") else p.name
                  for p in run.checkpoints.iterdir())


@pytest.fixture
def run(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "run")
    run.create()
    return run


def test_a_commit_below_older_checkpoints_retires_neither_them_nor_itself(run):
    save(run, 30)
    save(run, 40)
    save(run, 10)  # a run that started over below them (they did not verify)
    save(run, 20)
    assert steps(run) == [40, 30, 20, 10]
    save(run, 50)  # keep=2 of what is at or below the commit
    assert steps(run) == [50, 40]


def test_a_replacement_that_crashed_between_its_renames_is_put_back(run, monkeypatch):
    save(run, 10, seed=0)
    renames = []

    def crash_at_the_second(src, dst):
        renames.append(dst)
        if len(renames) == 2:  # step-10 is aside, the new one not yet in place
            raise KeyboardInterrupt("the process dies here")
        os.replace(src, dst)

    monkeypatch.setattr(store.os, "rename", crash_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        save(run, 10, seed=1)  # a resume that redid step 10 saves it again
    monkeypatch.undo()
    assert names(run) == [".old-step-10", ".tmp-step-10"]

    resume.tidy(run.checkpoints, run.event)
    assert names(run) == ["step-10"]
    restored = build_state(BYTES, seed=2)
    CheckpointManager(run, "vanilla", 10, 2, 0, 1, restored.parts, CPU, False).restore(
        store.verify(run.checkpoints / "step-10"))
    newer = build_state(BYTES, seed=1).parts.model.state_dict()
    for key, value in restored.parts.model.state_dict().items():
        assert torch.equal(value, newer[key]), key  # the new save, which was complete
    assert [e["step"] for e in read_jsonl(run.events) if e["event"] == "checkpoint_recovered"
            ] == [10]


def test_the_old_copy_is_put_back_when_the_new_one_does_not_verify(run):
    save(run, 10, seed=0)
    folder = run.checkpoints / "step-10"
    os.rename(folder, run.checkpoints / ".old-step-10-aaaaaaaa")
    save(run, 10, seed=1)
    os.rename(folder, run.checkpoints / ".tmp-step-10-bbbbbbbb")
    state = run.checkpoints / ".tmp-step-10-bbbbbbbb" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))

    resume.tidy(run.checkpoints, run.event)
    assert names(run) == ["step-10"]
    assert store.verify(folder).step == 10


def test_retentions_leftovers_and_uncommitted_saves_are_removed_not_put_back(run):
    save(run, 10)
    save(run, 20)
    os.rename(run.checkpoints / "step-10", run.checkpoints / ".old-step-10-aaaaaaaa")
    (run.checkpoints / ".tmp-step-30-bbbbbbbb").mkdir()
    (run.checkpoints / ".tmp-step-30-bbbbbbbb" / "state.pt").write_bytes(b"half")
    resume.tidy(run.checkpoints, run.event)
    assert names(run) == ["step-20"]


def test_a_commit_that_fails_on_rank_0_is_a_failed_save_and_the_final_one_is_tried_again(
        tmp_path, monkeypatch):
    """ENOSPC or EDQUOT on manifest.json (the commit's last write), EIO at its fsync: the
    OSError went out of the loop as a traceback, while the other ranks took the step as
    saved. It is now that save's failure, discarded as any other, and `finish` writes the
    final checkpoint once more. The full quota is a stand-in (it raises once)."""
    import errno

    from pyrecover.bench.state import build_state
    from pyrecover.checkpoint import CheckpointManager, store

    parts = build_state(200_000).parts
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "vanilla", 2, 2, 0, 1, parts, torch.device("cpu"), False)
    real, calls = store.Pending.commit, []

    def quota(self, *args, **kwargs):
        calls.append(self.step)
        if len(calls) == 1:
            raise OSError(errno.EDQUOT, "Disk quota exceeded", str(self.tmp / "manifest.json"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(store.Pending, "commit", quota)
    manager.at_step(2)  # no exception: the save failed
    assert manager.last_saved_step is None and manager.failed_step == 2
    failed = [e for e in run.read_events() if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and "rank 0's commit: OSError: [Errno 122] Disk quota" in \
        failed[0]["reason"]
    assert not list(run.checkpoints.glob(".tmp-step-*"))  # discarded, nothing left behind
    manager.finish(2)  # the final save: tried again, and this time it commits
    assert calls == [2, 2] and store.verify(run.checkpoints / "step-2").step == 2
