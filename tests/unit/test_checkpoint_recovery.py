"""What retention may retire: real vanilla checkpoints of a small state, written by the real
manager into a real run directory."""

from __future__ import annotations

import pytest
import torch

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, store
from pyrecover.rundir import RunDir

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
