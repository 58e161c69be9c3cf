"""Storage that fails: one line and exit code 1 (a fault, not a config error), and a metrics
line that cannot be written never stops the training."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from helpers import pyrecover, tiny_args


def one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr
    return lines[0]


def test_storage_that_cannot_hold_a_folder_is_one_line_exit_1(tmp_path, corpus):
    storage = tmp_path / "storage"
    storage.write_text("a file where the storage folder should be")
    done = pyrecover("train", *tiny_args(storage, corpus, "run"))
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert line.startswith(f"error: storage: cannot create {storage / 'run'}")


def test_a_disk_full_at_start_is_one_line_exit_1(tmp_path, corpus):
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run"), max_file_bytes=64)
    assert done.returncode == 1
    line = one_error_line(done.stderr)
    assert line.startswith(f"error: storage: cannot write {tmp_path / 'run' / 'run.yaml'}")
    assert "File too large" in line


def test_a_metrics_file_that_cannot_be_appended_to_does_not_stop_training(tmp_path, corpus):
    (tmp_path / "run" / "metrics.jsonl").mkdir(parents=True)  # every append fails
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=10"))
    assert done.returncode == 0, done.stderr
    assert "could not append to" in done.stderr and "finished at step 10" in done.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-10" / "manifest.json").is_file()


def test_at_two_ranks_storage_that_cannot_hold_the_run_is_one_line_from_rank_0(tmp_path,
                                                                               corpus):
    """Every rank finds it before the group; they agree once the group is up, so rank 0 says
    it and ends. Before, rank 0 held it for later and waited in the rendezvous for a rank 1
    that had already exited: until a launcher killed it, or the rendezvous timed out."""
    storage = tmp_path / "storage"
    storage.write_text("a file where the storage folder should be")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    env.update(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WANDB_MODE="disabled")
    argv = [sys.executable, "-m", "pyrecover", "train", *tiny_args(storage, corpus, "run")]
    ranks = [subprocess.Popen(argv, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:  # an event, not a time bound: a rank 0 left waiting never ends on its own
        said = [p.communicate(timeout=240)[1] for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [1, 1], said
    assert one_error_line(said[0]) == (
        f"error: storage: cannot create {storage / 'run'}: Not a directory")
    assert "error" not in said[1], said[1]  # rank 0 says it once



def test_a_convert_on_a_full_disk_is_one_line_exit_1_and_leaves_nothing(tmp_path, corpus):
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=10"))
    assert done.returncode == 0, done.stderr
    run = str(tmp_path / "run")
    out = tmp_path / "out"
    out.mkdir()
    # (export's formats on a full disk: tests/train/test_hf_export.py)
    for args in (("ckpt", "convert", run, "--to", "torch", str(out / "state.pt")),
                 ("ckpt", "convert", run, "--to", "dcp", str(out / "state-dcp"))):
        full = pyrecover(*args, max_file_bytes=4096)  # every file past 4 KiB: EFBIG
        assert full.returncode == 1, (args, full.stderr)
        line = one_error_line(full.stderr)
        assert line.startswith(f"error: storage: cannot write {out}/") and \
            "File too large" in line, (args, line)
        assert list(out.iterdir()) == [], args  # no temporary, no half-written file

    # With room, convert makes the folders its output path lacks (as export does).
    room = pyrecover("ckpt", "convert", run, "--to", "torch", str(out / "new" / "state.pt"))
    assert room.returncode == 0, room.stderr
    assert (out / "new" / "state.pt").is_file()
    under_file = pyrecover("ckpt", "convert", run, "--to", "torch",
                           str(out / "new" / "state.pt" / "x.pt"))
    assert under_file.returncode == 2
    assert "is a file, not a folder" in one_error_line(under_file.stderr)


def test_a_failed_final_save_of_a_run_without_checkpoints_says_it_starts_over(tmp_path, corpus):
    """It said `run the same command again to resume`, where there is nothing to resume."""
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=4",
                                         "checkpoint.interval=100"), max_file_bytes=300_000)
    assert done.returncode == 1, done.stderr
    line = one_error_line(done.stderr)
    assert "the checkpoint of step 4 could not be written" in line and "File too large" in line
    assert line.endswith("there is no valid checkpoint yet; fix the storage, then run the same "
                         "command again to start over at step 0"), line
    assert not (tmp_path / "run" / "checkpoints" / "step-4").exists()
