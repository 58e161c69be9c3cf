"""`pyrecover demo`, the README's first command (`make demo`), as a new user runs it."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import is_running, pyrecover

from pyrecover.rundir import read_jsonl


def test_the_demo_kills_its_run_resumes_it_and_the_loss_keeps_falling(tmp_path):
    done = pyrecover("demo", "--workdir", str(tmp_path), timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    killed = re.search(r"SIGKILL sent to the whole process group at step (\d+); the last "
                       r"committed checkpoint is step (\d+)", done.stdout)
    assert killed is not None, done.stdout[-3000:]
    killed_at, last_ckpt = int(killed[1]), int(killed[2])
    assert 0 < last_ckpt <= killed_at

    events = list(read_jsonl(tmp_path / "local-demo" / "events.jsonl"))
    (resume,) = [e for e in events if e["event"] == "resume"]
    assert resume["step"] == last_ckpt  # the newest committed checkpoint, nothing older
    assert [e["step"] for e in events if e["event"] == "finish"] == [300]
    assert f"resumed from {resume['path']} (step {last_ckpt})" in done.stdout
    # The demo itself fails unless the loss fell from the start to the kill and on to the end.
    summary = re.search(r"loss: step \d+ ([\d.]+) -> step \d+ \(killed\) ([\d.]+) -> step 300 "
                        r"\(finished\) ([\d.]+)", done.stdout)
    assert summary is not None, done.stdout[-3000:]
    first, before, last = map(float, summary.groups())
    assert last < before < first


def descendants(pid: int) -> set[int]:
    """descendants are the processes below `pid` now (/proc/PID/task/TID/children)."""
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            with contextlib.suppress(OSError):
                kids = {int(c) for c in (task / "children").read_text().split()}
                todo += sorted(kids - found)
                found |= kids
    return found


def test_a_demo_stopped_by_sigterm_stops_its_run_cleanly_and_leaves_no_process(tmp_path):
    """Its run is in a session of its own (so that the demo can kill all of it): a Ctrl-C
    or SIGTERM of the demo left the trainer and its workers training to the end."""
    demo = subprocess.Popen([sys.executable, "-m", "pyrecover", "demo", "--workdir",
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True,
                            env={k: v for k, v in os.environ.items()
                                 if not k.startswith(("PYRECOVER_", "SLURM_"))})
    metrics = tmp_path / "local-demo" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while demo.poll() is None and time.monotonic() < deadline:
            if any(m["step"] >= 3 for m in read_jsonl(metrics)):
                break
            time.sleep(0.1)
        below = descendants(demo.pid)
        assert len(below) >= 3  # the launcher and its two workers
        demo.send_signal(signal.SIGTERM)
        out, _ = demo.communicate(timeout=300)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "the demo was stopped: stopping its run cleanly" in out
    assert not [p for p in below if is_running(p)], out[-3000:]
    stops = [e for e in read_jsonl(tmp_path / "local-demo" / "events.jsonl")
             if e["event"] == "stop"]
    assert [s["reason"] for s in stops] == ["SIGTERM"]  # a clean stop, saved


def test_a_demo_leaves_a_live_demo_run_in_the_same_workdir_alone(tmp_path):
    """A second `pyrecover demo` in the same folder (another terminal) removed the first's
    run directory under its live trainer and trained in its place."""
    from pyrecover.rundir import RunDir
    from pyrecover.runlock import RunLock

    run = RunDir(tmp_path / "local-demo")
    run.create()
    (run.root / "mine").write_text("the live run's\n")
    with RunLock(run):
        done = pyrecover("demo", "--workdir", str(tmp_path), timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout == ""  # nothing built, removed or started
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: the previous demo run {run.root} is in use by a live run "
                           "(host "), line
    assert line.endswith("): let it finish, or give this demo another --workdir"), line
    assert (run.root / "mine").read_text() == "the live run's\n"


def test_a_file_where_the_demo_run_goes_is_one_line_exit_2_and_kept(tmp_path):
    """It built the corpus, then said `error: .../local-demo: Not a directory`, exit 1."""
    (tmp_path / "local-demo").write_text("mine\n")
    done = pyrecover("demo", "--workdir", str(tmp_path), timeout=120)
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        f"error: {tmp_path / 'local-demo'} is a file where the demo's run folder goes (every "
        "demo replaces that folder): move it away, or give this demo another --workdir"]
    assert (tmp_path / "local-demo").read_text() == "mine\n"
