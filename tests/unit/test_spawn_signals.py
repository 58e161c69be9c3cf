"""`train --nproc N`'s launcher hands a stop signal on to a worker only once the worker
catches it: a worker that catches SIGTERM but not yet the run's stop signal is not ended by
the stop signal's default action."""

from __future__ import annotations

import contextlib
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import started, starting_worker

from pyrecover.spawn import catching

# Catches TERM from the start; the run's stop signal (HUP) only once the test says so.
WORKER = starting_worker("SIGHUP")

LAUNCHER = """
import os, signal, sys
from pyrecover import spawn
sys.exit(spawn.spawn_local([sys.executable, "-c", sys.argv[1], sys.argv[2]], 1, os.environ,
                           stop=signal.SIGHUP))
"""


def wait_for(what, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the launcher ended first: {proc.communicate()}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_stop_signal_waits_for_a_worker_that_catches_sigterm_but_not_it_yet(tmp_path: Path):
    with started([sys.executable, "-c", LAUNCHER, WORKER, str(tmp_path)]) as launcher:
        wait_for(lambda: (tmp_path / "ready").exists()
                 and catching(launcher.pid, signal.SIGHUP), launcher)
        os.kill(launcher.pid, signal.SIGHUP)
        # Handed on after the HUP (the lower number goes first): once the worker has the TERM,
        # the launcher has dealt with the HUP, which killed it where it was sent at once.
        os.kill(launcher.pid, signal.SIGTERM)
        wait_for((tmp_path / "term").exists, launcher)
        (tmp_path / "go").touch()
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err


# The launcher above, its first worker's start held (subprocess.Popen, the standard library's)
# until the test says on stdin that its signal was sent: says `starting` first.
LAUNCHER_HELD_AT_START = """
import os, signal, subprocess, sys
from pyrecover import spawn
class HeldAtStart(subprocess.Popen):
    def __init__(self, *args, **kwargs):
        os.write(1, b"starting\\n")
        sys.stdin.readline()
        super().__init__(*args, **kwargs)
subprocess.Popen = HeldAtStart
sys.exit(spawn.spawn_local([sys.executable, "-c", sys.argv[1], sys.argv[2]], 1, os.environ,
                           stop=signal.SIGUSR2))
"""


def test_a_stop_signal_before_the_first_worker_started_reaches_it(tmp_path: Path):
    """SLURM's USR2 (or a preemption's TERM) that reached `train --nproc N` after it put in
    its handlers and before its first worker started went to no one: the workers trained on
    to the time limit and were killed there without a checkpoint."""
    worker = starting_worker("SIGUSR2")
    with started([sys.executable, "-c", LAUNCHER_HELD_AT_START, worker, str(tmp_path)],
                 stdin=subprocess.PIPE) as launcher:
        assert launcher.stdout.readline() == "starting\n", launcher.communicate()
        os.kill(launcher.pid, signal.SIGUSR2)
        launcher.stdin.write("sent\n")
        launcher.stdin.flush()
        wait_for((tmp_path / "ready").exists, launcher)
        (tmp_path / "go").touch()  # it catches USR2 now, and stops on it (exit 75)
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err


# The torchrun wrapper's relay (pyrecover.elastic_agent) without torch: USR2 is handed on to
# this process's children, workers started one after the other, one per folder in argv[2:],
# with torch's worker variables.
RELAY_WRAPPER = """
import os, signal, subprocess, sys
from pyrecover import elastic_agent
signal.signal(signal.SIGUSR2, elastic_agent.forward_to_children(signal.SIGUSR2))
env = {**os.environ, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "none"}
for folder in sys.argv[2:]:
    code = subprocess.Popen([sys.executable, "-c", sys.argv[1], folder], env=env).wait()
sys.exit(code)
"""
READ = {"x86_64": 0, "aarch64": 63}.get(platform.machine())  # read(2)'s number


def waits_in_read(pid: int) -> bool:
    """waits_in_read: a thread of `pid` other than its main one is blocked in read(2)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            if task.name != str(pid) and int((task / "syscall").read_text().split()[0]) == READ:
                return True
    return False


@pytest.mark.skipif(READ is None, reason="read(2)'s number is known for x86_64 and aarch64")
def test_the_wrappers_relay_waits_for_a_signal_once_it_holds_none(tmp_path: Path):
    """The torchrun wrapper's relay thread looked at the workers every 20 ms from its first
    held signal to the end of the job; it now sleeps until a signal is held again, and that
    one still reaches its worker."""
    folders = [tmp_path / "1", tmp_path / "2"]
    for folder in folders:
        folder.mkdir()
    with started([sys.executable, "-c", RELAY_WRAPPER, starting_worker("SIGUSR2"),
                  *map(str, folders)]) as launcher:
        threads = Path(f"/proc/{launcher.pid}/task")
        wait_for((folders[0] / "ready").exists, launcher)
        launcher.send_signal(signal.SIGUSR2)  # held: the worker catches only TERM yet
        wait_for(lambda: len(list(threads.iterdir())) == 2, launcher)  # the relay thread's
        (folders[0] / "go").touch()  # it catches USR2 now and exits 75 on it
        wait_for((folders[1] / "ready").exists, launcher)
        wait_for(lambda: waits_in_read(launcher.pid), launcher)  # nothing held: it sleeps
        launcher.send_signal(signal.SIGUSR2)
        wait_for(lambda: not waits_in_read(launcher.pid), launcher)  # woken: held again
        (folders[1] / "go").touch()
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err


def test_catching_reads_the_mask_of_each_signal_asked_about(tmp_path: Path):
    worker = subprocess.Popen([sys.executable, "-c", WORKER, str(tmp_path)])
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists():
            assert worker.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        assert catching(worker.pid, signal.SIGTERM) and catching(worker.pid)
        assert not catching(worker.pid, signal.SIGHUP)
        assert not catching(worker.pid, signal.SIGTERM, signal.SIGHUP)
    finally:
        worker.kill()
        worker.wait()


# The torchrun wrapper's relay with one worker started as the standard library starts one
# (subprocess.Popen's fork and exec, held in between until `exec` exists in argv[2]): all
# signals blocked across the fork; the child puts their default actions back, unblocks them
# and execs the worker with torch's worker variables. Says `handled` once it took a USR2.
RELAY_WRAPPER_HELD_FORK = """
import os, signal, sys, time
from pathlib import Path
from pyrecover import elastic_agent
folder = Path(sys.argv[2])
forward = elastic_agent.forward_to_children(signal.SIGUSR2)
def handle(signum, frame):
    forward(signum, frame)
    os.write(1, b"handled\\n")
signal.signal(signal.SIGUSR2, handle)
signal.signal(signal.SIGTERM, forward)  # torch's agent catches TERM once it starts workers
old = signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals))
pid = os.fork()
if pid == 0:
    (folder / "forked").touch()
    while not (folder / "exec").exists():
        time.sleep(0.01)
    for s in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(s, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, old)
    env = {**os.environ, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "none"}
    os.execve(sys.executable, [sys.executable, "-c", sys.argv[1], str(folder)], env)
signal.pthread_sigmask(signal.SIG_SETMASK, old)
code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
sys.exit(128 - code if code < 0 else code)
"""


def test_the_wrappers_relay_holds_a_stop_for_a_child_forked_and_not_yet_a_worker(
        tmp_path: Path):
    """torch's agent starts each worker by fork and exec; the relay took the forked child,
    which still had the agent's handlers, for a worker and sent it the stop signal, which
    killed it once it put back the default actions before its exec (exit 140: a crash)."""
    with started([sys.executable, "-c", RELAY_WRAPPER_HELD_FORK, starting_worker("SIGUSR2"),
                  str(tmp_path)]) as launcher:
        wait_for((tmp_path / "forked").exists, launcher)
        launcher.send_signal(signal.SIGUSR2)
        assert launcher.stdout.readline() == "handled\n", launcher.communicate()
        (tmp_path / "exec").touch()
        wait_for((tmp_path / "ready").exists, launcher)
        (tmp_path / "go").touch()  # it catches USR2 now, and stops on it (exit 75)
        _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, err
