"""`pyrecover status` asks run.lock whether a run with no recorded end is running or killed.

A held lock is a live run on any host. A free lock proves a death only for a holder on this
host: where flock is node-local (Lustre mounted `localflock`, NFS with `local_lock=all` or
`local_lock=flock`) a trainer on another node holds its lock unseen from here, so a free lock
last held from another host says "running or killed", never "killed". No sleeps: the dead
holder is a child that ran RunLock and has been reaped (or waited for without reaping, for
a zombie), and the held lock is held by this test itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from pyrecover import status, status_text
from pyrecover.rundir import RunDir
from pyrecover.runlock import RunLock, live_holder

OTHER_HOST = socket.gethostname() + "-other-node"


def _run_with_no_recorded_end(tmp_path) -> RunDir:
    run = RunDir(tmp_path / "exp")
    run.create()
    run.event("start", step=0)
    run.metric(step=1, loss=2.0, step_time=0.1)
    assert status._state(run.read_events()) == status.RUNNING_OR_KILLED
    return run


def _record_holder(run: RunDir, **holder) -> None:
    """Writes run.lock as RunLock.acquire does (host, pid, job_id, since), without holding it."""
    record = {"host": socket.gethostname(), "pid": os.getpid(), "job_id": None,
              "since": 1.0, **holder}
    run.lock_file.write_text(json.dumps(record) + "\n")


def _lock_and_exit(run: RunDir, reap: bool = True) -> subprocess.Popen:
    """A child process takes the run's lock with RunLock, as a trainer's rank 0 does, and
    exits without a word (as a SIGKILLed trainer would). With reap=False it is left a zombie:
    dead, its files closed and its lock gone, its pid not yet free (the caller reaps it)."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; "
         "from pyrecover.rundir import RunDir; from pyrecover.runlock import RunLock; "
         "RunLock(RunDir(Path(sys.argv[1]))).acquire(); import os; os._exit(0)",
         str(run.root)])
    if reap:
        assert child.wait() == 0
    else:  # waits for its exit, leaving it unreaped
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    return child


def test_a_free_lock_last_held_from_another_host_is_not_called_killed(tmp_path):
    """The review's case: storage whose flock is node-local; the trainer on another node holds
    the lock, this node sees it free. Status keeps the careful answer."""
    run = _run_with_no_recorded_end(tmp_path)
    _record_holder(run, host=OTHER_HOST, pid=12345, job_id="77")
    assert live_holder(run) is None
    s = status.read(run.root)
    assert s.state == "running or killed"
    assert "killed (no end recorded)" not in status_text.render(s)


def test_a_free_lock_whose_holder_on_another_host_had_this_hosts_dead_pid_is_not_killed(
        tmp_path):
    """Another node's pid says nothing about this node's processes: a pid gone here does not
    make the other host's holder dead."""
    run = _run_with_no_recorded_end(tmp_path)
    dead = _lock_and_exit(run).pid
    _record_holder(run, host=OTHER_HOST, pid=dead)
    assert live_holder(run) is None
    assert status.read(run.root).state == "running or killed"


def test_a_free_lock_last_held_on_this_host_by_a_dead_process_is_killed(tmp_path):
    run = _run_with_no_recorded_end(tmp_path)
    dead = _lock_and_exit(run).pid
    recorded = json.loads(run.lock_file.read_text())
    assert (recorded["host"], recorded["pid"]) == (socket.gethostname(), dead)
    assert live_holder(run) == ""
    s = status.read(run.root)
    assert s.state == "killed (no end recorded)"
    assert "state       killed (no end recorded)" in status_text.render(s)


def test_a_zombie_holder_on_this_host_is_dead(tmp_path):
    """A holder killed but not yet reaped by its parent holds no lock and no files."""
    run = _run_with_no_recorded_end(tmp_path)
    zombie = _lock_and_exit(run, reap=False)
    try:
        assert live_holder(run) == ""
        assert status.read(run.root).state == "killed (no end recorded)"
    finally:
        assert zombie.wait() == 0


def test_a_free_lock_whose_holder_pid_on_this_host_is_alive_is_not_called_killed(tmp_path):
    """The lock is free, yet the recorded pid lives (reused by another process, or a holder
    between its release and its exit): no proof of a death, so the careful answer."""
    run = _run_with_no_recorded_end(tmp_path)
    _record_holder(run, pid=os.getpid())
    assert live_holder(run) is None
    assert status.read(run.root).state == "running or killed"


@pytest.mark.parametrize("content", ["", "not json\n", "[1, 2]\n", '{"pid": 1}\n',
                                     '{"host": "%s", "pid": 0}\n',
                                     '{"host": "%s", "pid": -1}\n',
                                     '{"host": "%s", "pid": "12"}\n',
                                     '{"host": "%s", "pid": true}\n',
                                     '{"host": "%s"}\n'])
def test_a_free_lock_naming_no_usable_holder_is_not_called_killed(tmp_path, content):
    """An empty, garbled or incomplete record proves nothing (and pid 0 or -1 must never
    reach os.kill, where they would signal whole process groups)."""
    run = _run_with_no_recorded_end(tmp_path)
    run.lock_file.write_text(content.replace("%s", socket.gethostname()))
    assert live_holder(run) is None
    assert status.read(run.root).state == "running or killed"


@pytest.mark.parametrize("host", [socket.gethostname(), OTHER_HOST])
def test_a_held_lock_is_running_whatever_host_it_names(tmp_path, host):
    run = _run_with_no_recorded_end(tmp_path)
    with RunLock(run):  # held by this process; status's own shared lock is refused
        if host != socket.gethostname():
            _record_holder(run, host=host, pid=4242, job_id="9")
            expected = f"host {host}, pid 4242, SLURM job 9"
        else:
            expected = f"host {host}, pid {os.getpid()}"
        assert live_holder(run) == expected
        assert status.read(run.root).state == f"running ({expected})"


def test_no_lock_file_cannot_tell(tmp_path):
    run = _run_with_no_recorded_end(tmp_path)
    assert live_holder(run) is None
    assert status.read(run.root).state == "running or killed"


def test_a_lock_still_held_by_an_earlier_start_of_the_same_job_is_a_fault_not_a_user_error(
        tmp_path, monkeypatch, corpus):
    """Rank 0's node lost its GPU and its process hangs unkillable in the driver, its flock
    held: the job's restart on other nodes was refused as a second run (exit 2, "config or
    data error", never requeued). The same job's holder is a fault: exit 1, requeued."""
    from helpers import pyrecover, tiny_args

    from pyrecover.runlock import HeldByThisJob, RunLocked

    run = RunDir(tmp_path / "run")
    run.create()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    held = RunLock(run).acquire()  # the stuck earlier step (this process holds it)
    try:
        with pytest.raises(HeldByThisJob, match="earlier start of this job .*SLURM job 4242"):
            RunLock(run).acquire(0.0)
        monkeypatch.setenv("SLURM_JOB_ID", "5151")  # another job's live run: the user's mistake
        with pytest.raises(RunLocked, match="is in use by another run"):
            RunLock(run).acquire(0.0)
        done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=2"),
                         env={"SLURM_JOB_ID": "4242", "PYRECOVER_LOCK_WAIT": "0"})
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().count("\n") == 0 and "earlier start of this job" in done.stderr
    finally:
        held.release()


def test_a_killed_run_s_last_interruption_is_the_kill_not_the_stop_before_it(tmp_path):
    """Stopped, started again, then SIGKILLed outside a job: status says killed, so the
    interruption it shows is that kill (the attempt's last record), not the old stop."""
    run = RunDir(tmp_path / "exp")
    run.create()
    for phase, at in (("process_start", 1.0), ("first_step", 2.0), ("stop_agreed", 5.0),
                      ("exit", 6.0), ("process_start", 10.0), ("first_step", 12.0)):
        run.event("phase", phase=phase, time=at)
        if phase == "first_step":
            run.event("start" if at == 2.0 else "resume", step=0 if at == 2.0 else 4,
                      time=at)
        if phase == "stop_agreed":
            run.event("stop", step=4, time=at)
    run.metric(step=5, loss=2.0, step_time=0.1, time=13.0)
    _lock_and_exit(run)
    s = status.read(run.root)
    assert s.state == "killed (no end recorded)"
    assert [r["phase"] for r in s.interruption] == ["last_record"]
    assert s.interruption[0]["time"] == 13.0


def test_a_run_its_job_script_requeued_after_a_kill_is_killed_not_maybe_running(tmp_path):
    """A task SIGKILLed on a compute node leaves no record of its own, only the job script's
    requeue (exit 137). Read from a login node, where the node-local lock says nothing,
    status said 'running or killed' though the script had already decided the attempt was
    over."""
    run = _run_with_no_recorded_end(tmp_path)
    _record_holder(run, host=OTHER_HOST, pid=12345, job_id="77")
    run.event("requeue", job_id="77", restart_count=0, exit_code=137, reason="crash")
    s = status.read(run.root)
    assert s.state == "killed (no end recorded)"
    # The requeued job starting up (its phases, no start yet) is the lock's to tell.
    run.event("phase", phase="process_start")
    with RunLock(run):
        assert status.read(run.root).state == f"running (host {socket.gethostname()}, " \
            f"pid {os.getpid()})"
