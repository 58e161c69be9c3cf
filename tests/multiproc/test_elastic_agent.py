"""torchrun through pyrecover.elastic_agent: the run's stop signal sent to the agent alone
reaches its workers as a clean stop (exit 75), and a crashed worker is a crash, not a stop.

Without the agent, torchrun dies of SIGUSR2 and its workers, in sessions of their own, never
hear of it: the job is killed instead of stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import events, load_export, pyrecover, starting_worker, tiny_args

from pyrecover import elastic_agent, spawn
from pyrecover.preempt import EXIT_STOPPED
from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.multiproc


def agent(storage: Path, corpus: Path, name: str, env: dict[str, str] | None = None,
          restarts: int = 0, steps: int = 200, stop: str = "USR2") -> subprocess.Popen:
    argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", stop,
            "--standalone", "--nproc-per-node", "2", "--max-restarts", str(restarts),
            "-m", "pyrecover", "train",
            *tiny_args(storage, corpus, name, f"train.max_steps={steps}", "train.log_interval=1",
                       "checkpoint.interval=50" if steps > 50 else "checkpoint.interval=5",
                       f"run.stop_signal={stop}")]
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_"))}
    return subprocess.Popen(argv, env={**clean, "WANDB_MODE": "disabled", **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_step(proc: subprocess.Popen, run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 240
    while max((m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")), default=0) < step:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.1)


def test_the_stop_signal_to_the_agent_alone_stops_every_worker_cleanly(tmp_path, corpus):
    proc = agent(tmp_path, corpus, "stop")
    wait_step(proc, tmp_path / "stop", 3)
    proc.send_signal(signal.SIGUSR2)  # the agent only, as SLURM signals a step's tasks
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    events = read_jsonl(tmp_path / "stop" / "events.jsonl")
    [stop] = [e for e in events if e["event"] == "stop"]
    assert stop["reason"] == "SIGUSR2" and stop["step"] >= 3
    assert (tmp_path / "stop" / "checkpoints" / f"step-{stop['step']}" / "manifest.json").is_file()
    # torch's agent logged the clean stop as an ERROR, "failed (exitcode: 75)", a crash to
    # whoever reads the job's log: one line of pyrecover's says what it was instead.
    assert "exitcode: 75" not in stderr and "ChildFailedError" not in stderr, stderr[-3000:]
    assert elastic_agent.STOPPED_CLEANLY in stderr, stderr[-3000:]


def test_sigterm_to_the_agent_gives_the_workers_all_the_time_their_save_takes(tmp_path,
                                                                              corpus):
    """Preemption and scancel SIGTERM the agent. torch's own handling forwards it and then
    SIGKILLs the workers after its shutdown timeout (30 s, and fixed before torch 2.12), so a
    large model's stop checkpoint was killed mid-write. With a timeout of 0 torch would kill
    them at once: the stop must still be saved, and the agent exit 75."""
    proc = agent(tmp_path, corpus, "term", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"})
    wait_step(proc, tmp_path / "term", 3)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    [stop] = [e for e in read_jsonl(tmp_path / "term" / "events.jsonl") if e["event"] == "stop"]
    assert stop["reason"] == "SIGTERM"
    assert (tmp_path / "term" / "checkpoints" / f"step-{stop['step']}" / "manifest.json").is_file()


def test_a_stop_signal_torch_handles_itself_gives_the_workers_the_time_their_save_takes(
        tmp_path, corpus):
    """run.stop_signal HUP (or INT, QUIT): torch's agent forwarded it and then SIGKILLed the
    workers after its shutdown timeout, as it did SIGTERM, so the time limit's stop
    checkpoint of a large model was killed mid-write and the agent exited 129."""
    proc = agent(tmp_path, corpus, "hup", env={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "0"},
                 stop="HUP")
    wait_step(proc, tmp_path / "hup", 3)
    proc.send_signal(signal.SIGHUP)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    [stop] = [e for e in read_jsonl(tmp_path / "hup" / "events.jsonl") if e["event"] == "stop"]
    assert stop["reason"] == "SIGHUP"
    assert (tmp_path / "hup" / "checkpoints" / f"step-{stop['step']}" / "manifest.json").is_file()


def test_a_crashed_worker_is_a_crash_code_not_a_stop(tmp_path, corpus):
    proc = agent(tmp_path, corpus, "crash", env={
        "PYRECOVER_KILL_AT_STEP": "3", "PYRECOVER_KILL_RANK": "1",
        "PYRECOVER_KILL_TARGET": "self"})
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode not in (0, 2, EXIT_STOPPED), stderr[-3000:]
    assert "stop" not in [e["event"] for e in read_jsonl(tmp_path / "crash" / "events.jsonl")]
    assert "failed (exitcode: " in stderr, stderr[-3000:]  # torch's own line, as it was
    assert elastic_agent.STOPPED_CLEANLY not in stderr, stderr[-3000:]


def test_torchruns_own_restart_resumes_the_killed_workers_to_the_unbroken_model(tmp_path,
                                                                             corpus):
    """`torchrun --max-restarts 1`: a worker killed mid-run, the agent starts both again in
    the same job, against the same store; they resume from the last checkpoint and end on the
    model of a run never interrupted, and the restarted attempt blames no one."""
    once = tmp_path / "kill-once"
    proc = agent(tmp_path, corpus, "again", restarts=1, steps=20, env={
        "PYRECOVER_KILL_AT_STEP": "13", "PYRECOVER_KILL_RANK": "1",
        "PYRECOVER_KILL_TARGET": "self", "PYRECOVER_KILL_ONCE": str(once)})
    _, stderr = proc.communicate(timeout=400)
    assert proc.returncode == 0, stderr[-3000:]
    assert once.exists()  # the kill happened
    run_dir = tmp_path / "again"
    [resume] = events(run_dir, "resume")
    assert resume["step"] == 10
    assert "stopped because rank" not in stderr
    ref = pyrecover("train", "--nproc", "2", *tiny_args(tmp_path, corpus, "ref",
                                                        "train.max_steps=20"))
    assert ref.returncode == 0, ref.stderr[-3000:]
    models = []
    for name in ("again", "ref"):
        done = pyrecover("ckpt", "export", str(tmp_path / name), "--out",
                         str(tmp_path / f"{name}.pt"))
        assert done.returncode == 0, done.stderr[-3000:]
        models.append(load_export(tmp_path / f"{name}.pt"))
    assert models[0].keys() == models[1].keys()
    assert all(torch.equal(models[0][k], models[1][k]) for k in models[0])


@pytest.mark.parametrize("codes, expected", [
    ([75, 75], 75), ([75], 75), ([75, -15], 75), ([75, -9], 75),  # the agent ended the rest
    ([1, 75], 1), ([75, -11], 139), ([-15, -15], 143), ([-9], 137), ([2, 75], 2), ([], 1),
])
def test_the_agents_exit_code_is_75_only_when_every_failed_worker_stopped(codes, expected):
    assert elastic_agent.exit_code(codes) == expected


def test_children_are_found_by_parent_pid():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in elastic_agent.children(os.getpid())
        assert os.getpid() not in elastic_agent.children(os.getpid())
    finally:
        child.kill()
        child.wait()


def test_a_child_is_a_worker_only_once_it_runs_with_torchs_worker_variables():
    """A child forked and not yet exec'd is not yet known (None); one started without torch's
    worker variables (a helper) is not a worker."""
    own = elastic_agent._environ("self")
    argv = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    worker_env = {**os.environ, "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "x"}
    helper_env = {k: v for k, v in worker_env.items() if k != "LOCAL_RANK"}
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, env=env)
             for env in (worker_env, helper_env)]
    fork = os.fork()
    if fork == 0:  # the test's fork: it stays one until it is killed
        try:
            signal.pause()
        finally:
            os._exit(0)
    try:
        kinds = [elastic_agent.is_worker(p.pid, own) for p in procs]
        assert kinds == [True, False]
        assert elastic_agent.is_worker(fork, own) is None
    finally:
        os.kill(fork, signal.SIGKILL)
        os.waitpid(fork, 0)
        for p in procs:
            p.communicate()
    assert elastic_agent.is_worker(fork, own) is False  # gone


# A worker still in Python's start-up, before catch_early put its handlers in: it catches
# TERM from the start, the run's stop signal (USR2) only once the test says so.
STARTING_WORKER = starting_worker("SIGUSR2")


def test_the_stop_signal_waits_for_a_worker_that_does_not_catch_it_yet(tmp_path):
    """The agent sent the stop signal to every worker at once: one still starting died of
    it, and the job script counted the run as crashed (exit 140)."""
    argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
            "--standalone", "--nproc-per-node", "1", "--max-restarts", "0", "--no-python",
            sys.executable, "-c", STARTING_WORKER, str(tmp_path)]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        wait_for(lambda: (tmp_path / "ready").exists()
                 and spawn.catching(proc.pid, signal.SIGUSR2, signal.SIGTERM), proc)
        proc.send_signal(signal.SIGUSR2)
        # Handed on after the USR2 (the lower number goes first): once the worker has the
        # TERM, the agent has dealt with the USR2, which killed it where it was sent at once.
        proc.send_signal(signal.SIGTERM)
        wait_for((tmp_path / "term").exists, proc)
        (tmp_path / "go").touch()
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == EXIT_STOPPED, err[-3000:]


def test_the_stop_signal_before_the_workers_start_reaches_them_once_started(tmp_path):
    """SLURM's USR2 that reached node 0's agent while it waited in the rendezvous for node 1
    (or imported torch) found no worker to hand it on to and was dropped: the workers then
    trained on to the time limit, and were killed there without a checkpoint."""
    port = spawn.free_port()

    def node(folder: Path) -> subprocess.Popen:
        folder.mkdir()
        argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
                "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "stop-early", "--no-python", sys.executable, "-c",
                STARTING_WORKER, str(folder)]
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)

    first = node(tmp_path / "0")
    second = None
    try:
        wait_for(lambda: spawn.catching(first.pid, signal.SIGUSR2), first)
        assert not elastic_agent.children(first.pid)  # node 1 is not there: no worker yet
        first.send_signal(signal.SIGUSR2)
        second = node(tmp_path / "1")
        wait_for((tmp_path / "0" / "ready").exists, first)
        (tmp_path / "0" / "go").touch()  # it catches USR2 now, and stops on it (exit 75)
        _, err = first.communicate(timeout=120)
    finally:
        kill_agents(first, second)
    assert first.returncode == EXIT_STOPPED, err[-3000:]


def kill_agents(*agents: subprocess.Popen | None) -> None:
    """kill_agents ends the agents still running, each started in a session of its own, and
    their workers, which torch starts in sessions of theirs."""
    for proc in agents:
        if proc is not None and proc.poll() is None:
            workers = elastic_agent.children(proc.pid)
            os.killpg(proc.pid, signal.SIGKILL)
            for pid in workers:
                os.kill(pid, signal.SIGKILL)
            proc.communicate()


def wait_for(what, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert proc.poll() is None, f"the agent ended first: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sigterm_before_the_workers_start_is_a_clean_stop_after_their_first_step(tmp_path,
                                                                                corpus):
    """A preemption's (or scancel's) SIGTERM that reached node 0's agent while it waited in
    the rendezvous for node 1 (or imported torch) ended it with 143, which the job script
    counts as a crash, a failure against max_restarts, where the trainer under srun or
    `train --nproc` takes it as a stop after its first step (75, requeued, not counted)."""
    port = spawn.free_port()
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("PYRECOVER_", "SLURM_", "TORCHELASTIC_"))}

    def node() -> subprocess.Popen:
        argv = [sys.executable, "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
                "--nnodes", "2", "--nproc-per-node", "1", "--max-restarts", "0",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "term-early", "-m", "pyrecover", "train",
                *tiny_args(tmp_path, corpus, "early", "train.max_steps=200",
                           "checkpoint.interval=50")]
        return subprocess.Popen(argv, env={**clean, "WANDB_MODE": "disabled"},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)

    first = node()
    second = None
    try:
        wait_for(lambda: spawn.catching(first.pid, signal.SIGUSR2), first)  # in its main
        first.send_signal(signal.SIGTERM)  # node 1 is not there: no worker yet
        second = node()
        _, err = first.communicate(timeout=240)
        assert first.returncode == EXIT_STOPPED, err[-3000:]
        second.communicate(timeout=240)  # its worker stopped with node 0's (75)
    finally:
        kill_agents(first, second)
    [stop] = events(tmp_path / "early", "stop")
    assert stop["reason"] == "SIGTERM" and stop["step"] >= 1
    assert (tmp_path / "early" / "checkpoints" / f"step-{stop['step']}" / "manifest.json").is_file()


@pytest.mark.parametrize("signum", [signal.SIGUSR2, signal.SIGINT])
def test_a_stop_under_max_restarts_is_not_restarted(tmp_path, corpus, signum):
    """`torchrun --max-restarts 1`: the agent took the workers' clean stop (75) for a
    failure and started them again; they resumed and trained on past the time limit's
    signal (or a Ctrl-C), to the end of the run."""
    proc = agent(tmp_path, corpus, "again", restarts=1, steps=60)
    wait_step(proc, tmp_path / "again", 3)
    proc.send_signal(signum)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    assert len(events(tmp_path / "again", "start")) == 1
    assert not events(tmp_path / "again", "resume") and not events(tmp_path / "again", "finish")


def test_a_stop_the_workers_chose_themselves_is_not_restarted(tmp_path, corpus):
    """The job's end drawing near (a stop no signal told the agent of): under `torchrun
    --max-restarts 2` the workers' 75 was taken for a failure, twice; each restart resumed,
    found the deadline as near and stopped again, spending the restarts meant for crashes
    and the job's last seconds on start-ups."""
    end = f"{time.time() + 32:.0f}"  # inside the trainer's 30 s margin within seconds
    proc = agent(tmp_path, corpus, "deadline", restarts=2, steps=200,
                 env={"PYRECOVER_JOB_END_TIME": end})
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == EXIT_STOPPED, stderr[-3000:]
    assert len(events(tmp_path / "deadline", "start")) == 1, stderr[-3000:]
    assert not events(tmp_path / "deadline", "resume")
    [stop] = events(tmp_path / "deadline", "stop")
    assert stop["reason"] != "SIGUSR2"
    assert elastic_agent.STOPPED_CLEANLY in stderr


def test_torchs_failure_line_for_a_75_is_held_until_the_end_tells_whether_it_was_a_stop():
    """A worker that exited 75 first, while another crashed, is still torch's failure: its
    line comes out as torch logged it (release); only a clean stop drops it."""
    logger = logging.getLogger(elastic_agent.CleanStopLog.LOGGER)
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger.addHandler(handler)
    line = "failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s"
    try:
        for ending in ("release", "drop"):
            seen.clear()
            log = elastic_agent.CleanStopLog()
            logger.error(line, 75, 0, 1, "python")
            logger.error(line, -9, 1, 2, "python")
            assert [r.args[0] for r in seen] == [-9]
            getattr(log, ending)()
            logger.error(line, 75, 0, 3, "python")  # the filter is gone either way
            assert [r.args[0] for r in seen] == ([-9, 75, 75] if ending == "release"
                                                 else [-9, 75])
    finally:
        logger.removeHandler(handler)
