"""Clean stops: a signal or the job's deadline saves, exits 75, and the run resumes bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import load_export, pyrecover, tiny_args

from pyrecover.preempt import CTRL_C, EXIT_STOPPED
from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc

LONG = ("train.max_steps=200", "checkpoint.interval=50", "train.log_interval=1")


def args(storage: Path, corpus: Path, name: str) -> list[str]:
    return ["train", "--nproc", "2", *tiny_args(storage, corpus, name, *LONG)]


def export(run_dir: Path) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}.pt"
    assert pyrecover("ckpt", "export", str(run_dir), "--out", str(out)).returncode == 0
    return load_export(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, corpus) -> dict[str, torch.Tensor]:
    storage = tmp_path_factory.mktemp("ref")
    done = pyrecover(*args(storage, corpus, "ref"))
    assert done.returncode == 0, done.stderr
    return export(storage / "ref")


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    """wait_for_step returns once the run logged `step` (fails if it ended or never did)."""
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
        if steps and max(steps) >= step:
            return
        time.sleep(0.05)
    raise AssertionError(f"the run never logged step {step} (exit {proc.poll()})")


def run_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    # Each step sleeps 0.05 s (the numbers are unchanged), so the steps left after the one
    # a test waits for take far longer than a poller starved by a busy machine may lag.
    env["PYRECOVER_STEP_DELAY"] = "0.05"
    return env


def signal_after(argv: list[str], run_dir: Path, sig: int, after_step: int,
                 group: bool = True) -> subprocess.CompletedProcess:
    """Start the run, send `sig` to its whole process group (`group`, as a shell's `kill
    -PGID` or a terminal does; else to the launcher alone) once it logged `after_step`."""
    proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *argv], env=run_env(),
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, run_dir, after_step)
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, None, err)


def assert_one_clean_stop(run_dir: Path, reason: str) -> dict:
    events = list(read_jsonl(run_dir / "events.jsonl"))
    stop = [e for e in events if e["event"] == "stop"]
    assert len(stop) == 1 and stop[0]["reason"] == reason, events
    saved = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert saved[-1] == stop[0]["step"] < 200  # the stop step itself was saved
    return stop[0]


# SIGINT: here a `kill -INT -PGID`, to the launcher and every worker as a terminal's Ctrl-C
# is, and handed on by the launcher too (a kill(2): nothing tells it the workers have it):
# each worker takes the two as one (preempt.INT_AGAIN_S).
@pytest.mark.parametrize("sig, reason", [(signal.SIGUSR2, "SIGUSR2"),
                                         (signal.SIGTERM, "SIGTERM"),
                                         (signal.SIGINT, "SIGINT")])
def test_a_stop_signal_saves_exits_75_and_the_resumed_run_is_bitwise(tmp_path, corpus,
                                                                     reference, sig, reason):
    run_dir = tmp_path / "run"
    done = signal_after(args(tmp_path, corpus, "run"), run_dir, sig, after_step=20)
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    stop = [assert_one_clean_stop(run_dir, reason)]

    resumed = pyrecover(*args(tmp_path, corpus, "run"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"(step {stop[0]['step']}, 0 steps redone" in resumed.stderr
    model = export(run_dir)
    for key, value in reference.items():
        assert torch.equal(model[key], value), key

    report = json.loads(pyrecover("status", str(run_dir), "--json").stdout)
    assert report["state"] == "finished"
    assert report["restarts_by_cause"] == {f"stop ({reason})": 1}
    assert report["steps_lost"] == 0 and report["last_checkpoint"]["step"] == 200
    # One figure for what saves cost the loop, the stop checkpoint's span in it (ledger.py),
    # and the causes still add up to the wall time.
    book = report["ledger"]
    assert report["checkpoint_stall_seconds"] == book["causes"]["checkpoint_stall"] > 0
    assert sum(book["causes"].values()) == pytest.approx(book["wall_seconds"], abs=0.005)
    # Each attempt's own count (at the stop's agreement; at the finish), and the stop
    # checkpoint's span between the two.
    records = list(read_jsonl(run_dir / "events.jsonl"))
    at = {e["phase"]: e for e in records if e["event"] == "phase"}
    (finish,) = [e for e in records if e["event"] == "finish"]
    assert report["checkpoint_stall_seconds"] == pytest.approx(
        at["stop_agreed"]["checkpoint_stall_total"] + at["save_done"]["time"]
        - at["stop_agreed"]["time"] + finish["checkpoint_stall_total"], abs=0.003)


@pytest.mark.parametrize("stop", ["HUP", "XCPU"])
def test_a_stop_signal_of_any_name_to_the_launcher_alone_is_one_clean_stop(tmp_path, corpus,
                                                                           stop):
    """Under `--launcher spawn` SLURM signals the node's task, the launcher, only. With
    run.stop_signal HUP it died of it at once (exit 129) and its orphaned workers stopped on
    their parent-death SIGTERM, while the step around them was being torn down."""
    run_dir = tmp_path / "run"
    argv = [*args(tmp_path, corpus, "run"), "--set", f"run.stop_signal={stop}"]
    done = signal_after(argv, run_dir, getattr(signal, f"SIG{stop}"), after_step=20,
                        group=False)
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    assert_one_clean_stop(run_dir, f"SIG{stop}")


def test_a_sigint_to_the_launcher_alone_is_one_clean_stop(tmp_path, corpus):
    """What a Ctrl-C amounts to where the launcher cannot tell a terminal sent it (its output
    piped: `pyrecover train --nproc 2 2>&1 | tee log`), or a `kill -INT` of the launcher: it
    hands each worker one SIGINT, and they stop cleanly after the same step. A second SIGINT
    reaching a worker a second later would have made it quit at once, with no checkpoint."""
    run_dir = tmp_path / "run"
    done = signal_after(args(tmp_path, corpus, "run"), run_dir, signal.SIGINT, after_step=20,
                        group=False)
    assert done.returncode == EXIT_STOPPED, done.stderr[-3000:]
    assert_one_clean_stop(run_dir, "SIGINT")
    assert done.stderr.count(CTRL_C) == 1, done.stderr[-3000:]  # said once, by the launcher
    assert "KeyboardInterrupt" not in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("sender", ["terminal", "kill"])
def test_a_launcher_at_a_terminal_hands_on_a_kill_but_not_the_terminals_ctrl_c(tmp_path, corpus,
                                                                              sender):
    """A real terminal (a pty whose foreground group is the launcher's and its workers') and
    stderr a pipe (`pyrecover train --nproc 2 2>&1 | tee log`). Ctrl-C typed there reaches
    every worker, and the launcher, which sees the kernel sent it, hands on no second one,
    which a worker a second later would take for "quit at once". A `kill -INT` of the
    launcher alone, from another terminal, reaches no worker: the launcher hands it on, and
    the run stops as cleanly (it once took every SIGINT in the foreground for the terminal's,
    and the workers trained on)."""
    import fcntl
    import termios

    run_dir = tmp_path / "run"
    master, slave = os.openpty()

    def controlling_terminal() -> None:  # in the new session: the pty is its terminal
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *args(tmp_path, corpus, "run")],
                            env=run_env(), stdin=slave, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=controlling_terminal)
    os.close(slave)
    try:
        wait_for_step(proc, run_dir, 20)
        assert os.tcgetpgrp(master) == proc.pid  # the launcher's group is the foreground
        if sender == "terminal":
            os.write(master, b"\x03")  # Ctrl-C, typed
        else:
            os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        os.close(master)
    assert proc.returncode == EXIT_STOPPED, err[-3000:]
    assert_one_clean_stop(run_dir, "SIGINT")
    assert err.count(CTRL_C) == 1 and "KeyboardInterrupt" not in err, err[-3000:]


@pytest.mark.parametrize("nproc, stop", [(1, "USR2"), (2, "USR2"), (1, "HUP"), (2, "XCPU")])
def test_a_stop_signal_during_start_up_is_a_clean_stop_at_the_first_step(tmp_path, corpus,
                                                                          nproc, stop):
    """A preemption while the trainer still starts (imports, data, health check: seconds on
    a GPU node) ended it by the signal's default action (exit 140), which the job script
    counts as a failure, with no record. The signal goes to the process as soon as it
    catches it; under --nproc that is the launcher, before its workers exist, which hands
    it on once each worker catches it. A run.stop_signal of HUP or XCPU was not caught
    before the run read its config: it still ended the process (exit 129, 152)."""
    from pyrecover.spawn import catching

    argv = ["train", *(["--nproc", "2"] if nproc > 1 else []),
            *tiny_args(tmp_path, corpus, "run", *LONG, f"run.stop_signal={stop}")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *argv], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not catching(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, getattr(signal, f"SIG{stop}"))
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, err
    events = list(read_jsonl(tmp_path / "run" / "events.jsonl"))
    assert not [e for e in events if e["event"] == "start"][1:]  # it started once
    (stopped,) = [e for e in events if e["event"] == "stop"]
    assert stopped["reason"] == f"SIG{stop}" and stopped["step"] == 1
    assert [e["step"] for e in events if e["event"] == "checkpoint"] == [1]
    # Caught while it imported torch, before it read its data: from its first moment, not
    # once the run's own handlers were in (those come after the data and the health check).
    seen = {e["phase"]: e for e in events if e["event"] == "phase"}
    assert seen["signal_seen"]["time"] < seen["data_ready"]["time"], seen


def test_a_run_stops_on_its_own_before_the_job_ends_when_no_signal_comes(tmp_path, corpus):
    # No signal at all: only the end time the job script would pass in.
    end = time.time() + 30
    argv = ["train", "--nproc", "2",
            *tiny_args(tmp_path, corpus, "run", "train.max_steps=1000000", "train.log_interval=50")]
    done = pyrecover(*argv, env={"PYRECOVER_JOB_END_TIME": str(end),
                                 "PYRECOVER_DEADLINE_MARGIN": "2"})
    assert done.returncode == EXIT_STOPPED, done.stderr
    records = list(read_jsonl(tmp_path / "run" / "events.jsonl"))
    (stop,) = [e for e in records if e["event"] == "stop"]
    # It decided to stop before the job's end; the `stop` event itself follows the stop
    # checkpoint's save, which a busy machine's storage may push past it.
    (agreed,) = [e for e in records if e["event"] == "phase" and e["phase"] == "stop_agreed"]
    assert stop["reason"] == agreed["reason"] == "deadline" and agreed["time"] < end
    report = json.loads(pyrecover("status", str(tmp_path / "run"), "--json").stdout)
    assert report["state"] == "stopped (resumes when started again)"  # no job to requeue it
    assert report["last_checkpoint"]["step"] == stop["step"]


def _agree_worker(rank: int, world: int, port: int, codes: list[int], out) -> None:
    import torch.distributed as tdist

    from pyrecover import preempt

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                             world_size=world)
    try:
        out.put((rank, preempt.reason_name(preempt.agree(codes[rank], world))))
    finally:
        tdist.destroy_process_group()


@pytest.mark.parametrize("reasons, expected", [
    ((None, "SIGTERM"), "SIGTERM"),  # the signal reached rank 1 a moment before rank 0
    (("SIGUSR2", "SIGTERM"), "SIGTERM"),  # preemption outranks the time-limit warning
    (("deadline", None), "deadline"),
    ((None, None), None),
])
def test_every_rank_stops_for_the_same_reason_whichever_rank_saw_it(reasons, expected):
    import socket

    import torch.multiprocessing as mp

    from pyrecover import preempt

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    codes = [preempt.reason_code(r) for r in reasons]
    procs = [ctx.Process(target=_agree_worker, args=(r, 2, port, codes, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: expected, 1: expected}


def test_workers_whose_launcher_is_killed_stop_cleanly_instead_of_training_on(
        tmp_path, corpus, reference):
    """A kill -9 of `train --nproc 2` (or the OOM killer taking it) left both workers
    training to the end, holding the run's lock, with nothing said. Each now gets SIGTERM
    from the kernel when its launcher dies, and stops as on a preemption."""
    run_dir = tmp_path / "run"
    done = signal_after(args(tmp_path, corpus, "run"), run_dir, signal.SIGKILL, after_step=20,
                        group=False)  # (returns once the workers closed their stderr)
    assert done.returncode == -signal.SIGKILL
    assert_one_clean_stop(run_dir, "SIGTERM")
    resumed = pyrecover(*args(tmp_path, corpus, "run"))
    assert resumed.returncode == 0, resumed.stderr
    model = export(run_dir)
    for key, value in reference.items():
        assert torch.equal(model[key], value), key
