"""A Ctrl-C while `pyrecover train` still starts (before the run has its stop flag) quits at
once, as Python would, but as one exit code (130, as typer gives it), not a traceback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import is_running, started, tiny_args

from pyrecover.elastic_agent import children
from pyrecover.preempt import CTRL_C, INT_AGAIN_S
from pyrecover.spawn import CTRL_C_STARTING, catching, stops_on_ctrl_c


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_ctrl_c_while_the_cli_is_imported_quits_with_130_and_no_traceback(tmp_path, nproc):
    argv = ["train", "--nproc", str(nproc),
            *tiny_args(tmp_path, tmp_path / "no-corpus.parquet", "run")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *argv], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # Its early catch is in (pyrecover/__main__.py): it is importing the CLI now.
    while not catching(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err


# Stands for a slow import of argv[1] in the main thread: says so on stdout, then waits there
# for the test's SIGINT, whose KeyboardInterrupt comes out of that import as from a slow one.
PAUSED_IMPORT = """
import os, runpy, signal, sys, threading
module = sys.argv[1]
class Paused:
    def find_spec(self, name, path=None, target=None):
        if name == module and threading.current_thread() is threading.main_thread():
            sys.meta_path.remove(self)
            os.write(1, b"importing\\n")
            signal.pause()
        return None
sys.meta_path.insert(0, Paused())
sys.argv = ["pyrecover", *sys.argv[2:]]
runpy.run_module("pyrecover", run_name="__main__", alter_sys=True)
"""


@pytest.mark.parametrize(("module", "nproc"), [
    ("pyrecover.preempt", 1),  # pyrecover/__main__.py's first import, before its early catch
    ("pyrecover.cli", 2),  # the CLI, after it
    ("torch", 1),  # the CLI's search for torch's bytecode (startup.use_bytecode_cache)
    ("pyrecover.train", 1),  # the trainer's start (typer's own 130)
])
def test_a_ctrl_c_during_an_import_at_the_start_quits_with_130_and_no_traceback(
        tmp_path, corpus, module, nproc):
    """A SIGINT while `python -m pyrecover train` imported its first module printed Python's
    traceback of that import and ended the process by SIGINT."""
    argv = ["train", "--nproc", str(nproc), *tiny_args(tmp_path, corpus, "run")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    with started([sys.executable, "-c", PAUSED_IMPORT, module, *argv], env=env) as proc:
        assert proc.stdout.readline() == "importing\n", proc.communicate()
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err


@contextlib.contextmanager
def launcher(tmp_path: Path, corpus: Path):
    """launcher runs `pyrecover train --nproc 2` on the tiny config in a session of its own,
    its stderr in a file (a pipe would stay open as long as a worker outlives it), and yields
    (the process, that file); a launcher still running at the end is killed with its group."""
    argv = ["train", "--nproc", "2", *tiny_args(tmp_path, corpus, "run")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    err_file = tmp_path / "stderr"
    with err_file.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *argv], env=env,
                                start_new_session=True, stdout=subprocess.DEVNULL, stderr=err)
    try:
        yield proc, err_file
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def is_a_worker(pid: int) -> bool:
    """is_a_worker: child `pid` of `train --nproc` runs a worker's command line (`train
    --run-dir ...`), not the launcher's (`--nproc`), which a fork copies until it execs."""
    try:
        return b"--nproc" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:  # gone
        return False


def test_a_ctrl_c_while_the_workers_start_says_they_quit_without_a_checkpoint(tmp_path, corpus):
    """`train --nproc 2` said "stopping after this step with a checkpoint" to a Ctrl-C that
    reached workers still starting, which quit at once (exit 130) with none."""
    with launcher(tmp_path, corpus) as (proc, err_file):
        deadline = time.monotonic() + 120
        # Each worker is held the moment it caught the early signals (preempt.catch_early),
        # importing torch, until the launcher has spoken. Forked and not yet a worker, a
        # child catches what the launcher catches: its command line is still the launcher's.
        workers: list[int] = []
        while len(workers) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
            for pid in children(proc.pid):
                if pid not in workers and is_a_worker(pid) and catching(pid):
                    os.kill(pid, signal.SIGSTOP)
                    workers.append(pid)
            time.sleep(0.001)
        assert not any(map(stops_on_ctrl_c, workers)), "they started before the test stopped them"
        os.kill(proc.pid, signal.SIGINT)  # handed on to them, as a terminal's would reach them
        while "Ctrl-C" not in err_file.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
            time.sleep(0.01)
        for pid in workers:
            os.kill(pid, signal.SIGCONT)
        proc.wait(timeout=120)
    said = err_file.read_text()
    assert proc.returncode == 130 and "Traceback" not in said, said
    assert CTRL_C_STARTING in said and CTRL_C not in said, said
    # the Ctrl-C is what ended them: no "pyrecover: rank 0 (pid N) exited with code 130"
    # beside it, as if a rank had failed
    assert "exited with code" not in said, said


def test_a_sigint_as_the_workers_start_ends_them_before_the_launcher(tmp_path, corpus):
    """A SIGINT just after the first worker started and before the launcher handled SIGINT
    made the launcher exit 130 at once, and its workers went on to train a step and save
    it, printing after the shell's prompt had come back."""
    workers: list[int] = []
    with launcher(tmp_path, corpus) as (proc, err_file):
        listing = Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
        try:
            deadline = time.monotonic() + 120
            while not listing.read_text().split():  # no sleep: the moment is milliseconds long
                assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
            os.kill(proc.pid, signal.SIGSTOP)  # held there, its first worker started
            os.kill(proc.pid, signal.SIGINT)  # a `kill -INT`: to the launcher alone
            os.kill(proc.pid, signal.SIGCONT)
            workers = [int(pid) for pid in listing.read_text().split()]
            proc.wait(timeout=120)
            left = [pid for pid in workers if is_running(pid)]
        finally:
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    said = err_file.read_text()
    assert proc.returncode == 130 and "Traceback" not in said, said
    assert not left, f"workers {left} outlived the launcher: {said}"


def ctrl_c_while_rank_0_waits_for_rank_1(proc: subprocess.Popen, err_file: Path) -> list[int]:
    """ctrl_c_while_rank_0_waits_for_rank_1 holds rank 1 of launcher `proc` (SIGSTOP) in its
    start-up, waits until rank 0 has its stop flag (and waits for rank 1 to form the group,
    in C++, where no Python handler runs), and sends the launcher a SIGINT, handed on to
    both; returns the workers once the launcher has said the Ctrl-C line."""
    deadline = time.monotonic() + 120
    while not (len(workers := sorted(children(proc.pid))) == 2
               and all(map(catching, workers))):
        assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
        time.sleep(0.001)
    os.kill(workers[1], signal.SIGSTOP)  # rank 1 (started second) held in its start-up
    assert not stops_on_ctrl_c(workers[1]), "it started before the test stopped it"
    while not stops_on_ctrl_c(workers[0]):  # rank 0 has its stop flag: it waits for 1
        assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
        time.sleep(0.01)
    os.kill(proc.pid, signal.SIGINT)  # handed on to both
    while "Ctrl-C" not in err_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, err_file.read_text()
        time.sleep(0.01)
    return workers


def test_a_ctrl_c_while_one_worker_starts_ends_the_one_that_waits_for_it(tmp_path, corpus):
    """Rank 0 had its stop flag and waited for rank 1 to form the group; rank 1, still
    starting, quit on the Ctrl-C. The launcher gave rank 0 its 60 s of grace (meant for
    survivors of a crash to save what they hold: it held nothing), then 10 s more."""
    with launcher(tmp_path, corpus) as (proc, err_file):
        workers = ctrl_c_while_rank_0_waits_for_rank_1(proc, err_file)
        os.kill(workers[1], signal.SIGCONT)
        proc.wait(timeout=45)  # the grace's 60 s and more before
    said = err_file.read_text()
    assert proc.returncode == 130 and CTRL_C_STARTING in said, said


def test_a_second_ctrl_c_ends_workers_that_cannot_quit_by_themselves(tmp_path, corpus):
    """A worker waiting in C++ (the rendezvous, the store) runs no Python handler, so the
    first Ctrl-C could not quit it, and the second one, which quits a trainer at once,
    did not either: `train --nproc` waited for it (here, rank 0's 600 s rendezvous
    timeout); the user could only kill it."""
    with launcher(tmp_path, corpus) as (proc, err_file):
        ctrl_c_while_rank_0_waits_for_rank_1(proc, err_file)
        said_at = time.monotonic()  # a second SIGINT sooner is the same Ctrl-C
        while time.monotonic() - said_at < INT_AGAIN_S:
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGINT)  # rank 1 is still held: nothing else would end
        proc.wait(timeout=120)
    said = err_file.read_text()
    assert proc.returncode == 130 and CTRL_C_STARTING in said, said


def sleeping(pid: int) -> bool:
    """sleeping: the main thread of `pid` waits in a timed sleep (TCPStore's pause between
    two tries to connect, here), not in a read or a connect."""
    try:
        return "nanosleep" in Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        return False


def switches(pid: int) -> int:
    """switches counts the times the main thread of `pid` left the CPU (each sleep is one)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return sum(int(line.split()[1]) for line in lines if "ctxt_switches:" in line)


def test_a_ctrl_c_while_a_rank_connects_to_the_store_prints_no_cpp_trace(tmp_path, corpus):
    """A SIGINT while rank 1 waited between two tries to reach rank 0's store (TCPStore) made
    torch log a warning with ~15 lines of C++ stack trace ("Interrupted system call"), and so
    did the store closing its connection: the noise above pyrecover's own line."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYRECOVER_", "SLURM_", "TORCH_CPP"))}
    env.update(RANK="1", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    argv = [sys.executable, "-m", "pyrecover", "train", *tiny_args(tmp_path, corpus, "run")]
    with started(argv, env=env) as proc:
        with server:
            conn, _ = server.accept()  # rank 1 connects to the store: it is in that phase now
        conn.close()  # a store that went away: it pauses, then tries again, refused
        deadline = time.monotonic() + 120
        before = None
        for signum in (None, signal.SIGINT, None):  # the Ctrl-C in the pause between refusals
            while not (sleeping(proc.pid) and (before is None or switches(proc.pid) > before)):
                assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
                time.sleep(0.001)
            before = switches(proc.pid)  # a new pause begins with one more of them
            if signum is not None:
                os.kill(proc.pid, signum)
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    assert "frame #" not in err and "TCPStore" not in err and "Traceback" not in err, err
