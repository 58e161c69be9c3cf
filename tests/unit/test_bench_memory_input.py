"""`pyrecover bench memory` with bad input: one line, exit 2, before any process starts."""

from __future__ import annotations

import pytest
from helpers import TINY, pyrecover


@pytest.mark.parametrize("args, message", [
    (["--size-gb", "0"], "error: --size-gb must be > 0 (got 0)"),
    (["--repeat", "0"], "error: --repeat must be >= 1 (got 0)"),
    (["--steps", "0"], "error: --steps must be >= 1 (got 0)"),
    (["--warmup", "-1"], "error: --warmup must be >= 0 (got -1)"),
    (["--config", str(TINY), "--set", "data.path=no-such.parquet"],
     "data file 'no-such.parquet' does not exist"),
    (["--config", str(TINY), "--set", "train.global_batch_size=3"],
     "train.global_batch_size=3"),
    (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["--config", str(TINY), "--set", "train.device=cuda"],  # this machine has no GPU
     "2 processes on this machine need 2 GPUs, but 0 are visible"),
])
def test_bench_memory_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    done = pyrecover("bench", "memory", "--dir", str(tmp_path / "bench"), *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "bench").exists()  # a refused benchmark leaves no folder behind


def test_bench_memory_refuses_a_file_as_its_directory(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    done = pyrecover("bench", "memory", "--dir", str(target))
    assert done.returncode == 2
    assert done.stderr.strip() == f"error: --dir {target} is not a directory"


def test_bench_memory_refuses_a_snapshot_interval_below_one(tmp_path):
    done = pyrecover("bench", "memory", "--dir", str(tmp_path), "--snapshot-interval", "0",
                     "--config", str(TINY))
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --snapshot-interval must be >= 1 (got 0)"


def test_bench_memory_refuses_an_interval_that_takes_no_snapshot_in_the_window(tmp_path):
    """--snapshot-interval 100 --steps 3 measured no snapshot, and said its ratio was met."""
    done = pyrecover("bench", "memory", "--dir", str(tmp_path / "b"), "--snapshot-interval",
                     "100", "--steps", "3", "--config", str(TINY))
    assert done.returncode == 2
    assert done.stderr.strip() == ("error: --snapshot-interval 100 takes no snapshot in the 3 "
                                   "steps measured; give --steps 100 or more")
    assert not (tmp_path / "b").exists()
