"""Storage that fails: one line and exit code 1 (a fault, not a config error), and a metrics
line that cannot be written never stops the training."""

from __future__ import annotations

from helpers import pyrecover, tiny_args


def one_error_line(done) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def test_storage_that_cannot_hold_a_folder_is_one_line_exit_1(tmp_path, corpus):
    storage = tmp_path / "storage"
    storage.write_text("a file where the storage folder should be")
    done = pyrecover("train", *tiny_args(storage, corpus, "run"))
    assert done.returncode == 1
    assert one_error_line(done).startswith(f"error: storage: cannot create {storage / 'run'}")


def test_a_disk_full_at_start_is_one_line_exit_1(tmp_path, corpus):
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run"), max_file_bytes=64)
    assert done.returncode == 1
    line = one_error_line(done)
    assert line.startswith(f"error: storage: cannot write {tmp_path / 'run' / 'run.yaml'}")
    assert "File too large" in line


def test_a_metrics_file_that_cannot_be_appended_to_does_not_stop_training(tmp_path, corpus):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)  # every append fails
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=10"))
    assert done.returncode == 0, done.stderr
    assert "could not append to" in done.stderr and "finished at step 10" in done.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-10" / "manifest.json").is_file()
