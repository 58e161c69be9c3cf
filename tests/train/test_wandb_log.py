"""How far a wandb run got, read from the end of its real transaction log (wandb offline)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pyrecover import wandb_log

STEPS = 1500

WRITE = f"""
import sys, wandb
run = wandb.init(mode="offline", dir=sys.argv[1], id="abc123", project="p",
                 settings=wandb.Settings(silent=True, console="off", disable_git=True))
for step in range(1, {STEPS} + 1):
    run.log({{"loss": 1.0 / step, "lr": 3e-4, "note": "x" * (step % 97)}}, step=step)
run.log({{"big": "y" * 100_000}}, step={STEPS} + 1)  # one record across several blocks
run.finish()
"""


@pytest.fixture(scope="module")
def log_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("wandb")
    subprocess.run([sys.executable, "-c", WRITE, str(root)], check=True, timeout=300)
    (path,) = (root / "wandb").glob("offline-run-*-abc123/run-abc123.wandb")
    return path


def test_the_last_step_is_read_from_the_end_of_the_log(log_file, monkeypatch):
    assert log_file.stat().st_size > 8 * wandb_log.BLOCK
    assert wandb_log.last_history_step(log_file) == STEPS + 1
    monkeypatch.setattr(wandb_log, "TAIL", wandb_log.BLOCK)  # start mid-file, at a block
    assert wandb_log.last_history_step(log_file) == STEPS + 1


def test_a_log_cut_anywhere_reads_as_its_last_whole_history_record(log_file, tmp_path,
                                                                   monkeypatch):
    """A kill leaves the log cut at any byte: reading from a block boundary near the end
    agrees with reading the whole file, and never names a step past the cut."""
    size = log_file.stat().st_size
    steps = []
    for cut in range(size // 5, size, size // 23):
        part = tmp_path / f"cut-{cut}.wandb"
        shutil.copyfile(log_file, part)
        with part.open("r+b") as f:
            f.truncate(cut)
        monkeypatch.setattr(wandb_log, "TAIL", 1 << 30)
        whole = wandb_log.last_history_step(part)
        monkeypatch.setattr(wandb_log, "TAIL", wandb_log.BLOCK // 2)
        assert wandb_log.last_history_step(part) == whole
        steps.append(whole)
    assert steps == sorted(steps) and 0 < steps[0] < steps[-1] <= STEPS + 1


def test_what_is_not_a_wandb_log_reads_as_not_known(tmp_path):
    junk = tmp_path / "run-x.wandb"
    junk.write_bytes(b"not a log at all" * 100)
    assert wandb_log.last_history_step(junk) is None
    assert wandb_log.last_history_step(tmp_path / "missing.wandb") is None
    header_only = tmp_path / "run-y.wandb"
    header_only.write_bytes(b":W&B\x00\x00\x00")
    assert wandb_log.last_history_step(header_only) is None


def test_the_newest_start_s_log_is_found_by_its_start_time(tmp_path):
    for name in ("run-20261201_100000-abc", "offline-run-20261202_090000-abc",
                 "run-20261201_230000-abc", "offline-run-20261203_000000-other"):
        (tmp_path / name).mkdir()
        (tmp_path / name / f"run-{name.rsplit('-', 1)[1]}.wandb").write_bytes(b"")
    found = wandb_log.newest_log(tmp_path, "abc")
    assert found == tmp_path / "offline-run-20261202_090000-abc" / "run-abc.wandb"
    assert wandb_log.newest_log(tmp_path, "none") is None
