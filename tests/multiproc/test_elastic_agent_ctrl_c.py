"""Ctrl-C on torchrun through pyrecover.elastic_agent: the first is a clean stop, as it is for
a trainer (the workers save and exit 75, however long that takes), a second one quits at once.

torch's agent took SIGINT itself: it passed it on and SIGKILLed the workers after its
shutdown timeout, so a Ctrl-C's stop checkpoint could be killed mid-write. Real agents, real
trainers, a real terminal (a pty) for the terminal's own Ctrl-C.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import termios
import threading
import time

import pytest
from helpers import events, tiny_args
from test_elastic_agent import agent, wait_for, wait_step

from pyrecover import elastic_agent, spawn
from pyrecover.preempt import CTRL_C, EXIT_STOPPED, INT_AGAIN_S

pytestmark = pytest.mark.multiproc


def test_a_ctrl_c_to_the_agent_is_a_clean_stop_that_nothing_kills_mid_save(tmp_path, corpus):
    """With a shutdown timeout of 0 torch killed the workers at once: the stop must still be
    saved, and the agent exit 75 as the trainer does after a Ctrl-C (it exited 130)."""
    proc = agent(tmp_path, corpus, "int", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"})
    wait_step(proc, tmp_path / "int", 3)
    proc.send_signal(signal.SIGINT)  # a `kill -INT` of the agent alone
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    [stop] = events(tmp_path / "int", "stop")
    assert stop["reason"] == "SIGINT" and stop["step"] >= 3
    assert (tmp_path / "int" / "checkpoints" / f"step-{stop['step']}" / "manifest.json").is_file()


def test_a_ctrl_c_at_the_terminal_is_one_clean_stop(tmp_path, corpus):
    """The terminal's Ctrl-C goes to its foreground process group: the agent's, but not the
    workers', which torch starts in sessions of their own. The agent hands it on, once."""
    master, slave = os.openpty()
    argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
            "--standalone", "--nproc-per-node", "2", "--max-restarts", "0",
            "-m", "pyrecover", "train",
            *tiny_args(tmp_path, corpus, "tty", "train.max_steps=200", "train.log_interval=1",
                       "checkpoint.interval=50")]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_"))}
    proc = subprocess.Popen(  # a session of its own, whose controlling terminal is the pty
        argv, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),
        env={**clean, "WANDB_MODE": "disabled", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"})
    os.close(slave)
    output: list[bytes] = []
    reader = threading.Thread(target=_drain, args=(master, output), daemon=True)
    reader.start()
    try:
        wait_step(proc, tmp_path / "tty", 3)
        os.write(master, b"\x03")  # Ctrl-C, typed
        proc.wait(timeout=240)
        reader.join(timeout=60)
    finally:
        kill_agent(proc)
        os.close(master)
    said = b"".join(output).decode(errors="replace")
    assert proc.returncode == EXIT_STOPPED, said[-3000:]
    assert said.count(CTRL_C) == 1, said[-3000:]  # not once per worker
    [stop] = events(tmp_path / "tty", "stop")
    assert stop["reason"] == "SIGINT"
    assert (tmp_path / "tty" / "checkpoints" / f"step-{stop['step']}" / "manifest.json").is_file()


def kill_agent(proc: subprocess.Popen) -> None:
    """kill_agent ends the agent if it still runs, and its workers (in sessions of their
    own)."""
    if proc.poll() is None:
        for pid in elastic_agent.children(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.communicate()


def _drain(fd: int, into: list[bytes]) -> None:
    """_drain reads the terminal's output until the last process holding it has ended."""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: no process has the terminal open any more
            return
        if not chunk:
            return
        into.append(chunk)


def test_a_second_ctrl_c_ends_the_agent_whose_worker_waits_in_the_rendezvous(tmp_path, corpus):
    """A worker waiting in C++ for its peers (the rendezvous) runs no handler, so the first
    Ctrl-C's stop never comes; torch's agent waited all its shutdown timeout for it (600 s
    where a large save needs it), and a second Ctrl-C, which quits a trainer at once, only
    started the wait again. It ends the workers now, and the agent with 130."""
    proc = agent(tmp_path, corpus, "quit", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600"})
    own = elastic_agent._environ(proc.pid)
    try:
        wait_for(lambda: len(workers := [c for c in elastic_agent.children(proc.pid)
                                         if elastic_agent.is_worker(c, own)]) == 2
                 and all(map(spawn.catching, workers)), proc)
        workers = sorted(c for c in elastic_agent.children(proc.pid)
                         if elastic_agent.is_worker(c, own))
        os.kill(workers[1], signal.SIGSTOP)  # rank 1 held in its start-up
        wait_for(lambda: spawn.stops_on_ctrl_c(workers[0]), proc)  # rank 0 waits for it
        proc.send_signal(signal.SIGINT)
        said_at = time.monotonic()  # a second SIGINT sooner is the same Ctrl-C
        while time.monotonic() - said_at < INT_AGAIN_S:
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        kill_agent(proc)
    assert proc.returncode == 130, err[-3000:]
