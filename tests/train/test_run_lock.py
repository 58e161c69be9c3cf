"""One run directory has one live run: a second start is refused, a dead holder never blocks."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from helpers import pyrecover, tiny_args

from pyrecover.rundir import read_jsonl


def start_and_wait_until_training(storage: Path, corpus: Path) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    env["WANDB_MODE"] = "disabled"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyrecover", "train",
         *tiny_args(storage, corpus, "run", "train.max_steps=100000", "checkpoint.interval=5")],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if any(m.get("step", 0) >= 1 for m in read_jsonl(storage / "run" / "metrics.jsonl")):
            return proc
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the first run never logged a step")


def test_a_second_start_on_a_live_run_is_refused_and_a_dead_holder_does_not_block(tmp_path,
                                                                                   corpus):
    first = start_and_wait_until_training(tmp_path, corpus)
    try:
        second = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=3"))
        assert second.returncode == 2
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1, second.stderr
        assert lines[0].startswith(f"error: {tmp_path / 'run'} is in use by another run (host "
                                   f"{socket.gethostname()}, pid {first.pid})")
        # Two ranks: rank 0 is refused before the group forms, then tells rank 1 through it.
        pair = pyrecover("train", "--nproc", "2",
                         *tiny_args(tmp_path, corpus, "run", "train.max_steps=3"))
        assert pair.returncode == 2 and "is in use by another run" in pair.stderr, pair.stderr
        assert first.poll() is None  # the live run goes on, its in-flight saves untouched
        # status asks the lock: the run is live, and who holds it.
        assert pyrecover("status", str(tmp_path / "run"), "--json").stdout.count(
            f'"state": "running (host {socket.gethostname()}, pid {first.pid})"') == 1
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    records = list(read_jsonl(tmp_path / "run" / "events.jsonl"))
    events = [e["event"] for e in records]
    assert events.count("start") == 1 and "error" not in events
    # The refused start wrote nothing into the live run: no start-up phases (status would
    # count a restart), no health record, and run.yaml keeps the live run's limits.
    assert [e.get("phase") for e in records].count("process_start") == 1
    assert events.count("health") <= 1
    assert "max_steps: 100000" in (tmp_path / "run" / "run.yaml").read_text()
    state = json.loads(pyrecover("status", str(tmp_path / "run"), "--json").stdout)
    assert state["starts"] == 1 and state["restarts_by_cause"] == {}, state
    report = pyrecover("status", str(tmp_path / "run"))
    assert "state       killed (no end recorded)" in report.stdout, report.stdout

    # The holder died by SIGKILL: its flock went with it, so the next start goes ahead.
    third = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=3"))
    assert third.returncode == 0, third.stderr


def test_storage_without_file_locks_runs_without_the_guard_and_says_so(tmp_path, monkeypatch,
                                                                       caplog):
    """Lustre mounted without `flock` (and some FUSE or NFS setups) answers flock with ENOSYS.
    That used to escape as a crash, requeued until max_restarts. The run goes on, and the log
    says the guard is off. The one stand-in: fcntl.flock raising as such a mount does, since
    no file system here lacks locks."""
    import errno
    import fcntl

    from pyrecover.rundir import RunDir, StorageError
    from pyrecover.runlock import RunLock

    run = RunDir(tmp_path / "run")
    run.root.mkdir()

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="pyrecover"), RunLock(run) as lock:
        assert lock._fd is not None
    assert "has no file locks (Function not implemented)" in caplog.text
    assert "do not start this run twice" in caplog.text

    def broken(fd: int, op: int) -> None:  # any other failure is a storage error, as before
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(fcntl, "flock", broken)
    try:
        RunLock(run).acquire()
    except StorageError as exc:
        assert "cannot lock" in str(exc) and "Input/output error" in str(exc)
    else:
        raise AssertionError("an EIO from flock must not be taken for storage without locks")


def test_status_of_a_first_start_still_starting_up_names_its_process_then_says_it_was_killed(
        tmp_path, corpus):
    """A trainer that had recorded its start-up phases but not yet its start (rank 0 waiting
    for rank 1 to form the group) was `not started`, beside `starts 1`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    with socket.socket() as s:  # a port no peer comes to: rank 0 waits there for rank 1
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env.update(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WANDB_MODE="disabled")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyrecover", "train", *tiny_args(tmp_path, corpus, "run")],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 240
        while not any(e.get("phase") == "process_start"
                      for e in read_jsonl(tmp_path / "run" / "events.jsonl")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.returncode
            time.sleep(0.05)
        starting = json.loads(pyrecover("status", str(tmp_path / "run"), "--json").stdout)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert starting["state"] == f"starting up (host {socket.gethostname()}, pid {proc.pid})"
    assert starting["starts"] == 1
    killed = json.loads(pyrecover("status", str(tmp_path / "run"), "--json").stdout)
    assert killed["state"] == "killed (no end recorded)"
