"""Stopping, requeueing and resuming on a real local SLURM cluster (CPU, gloo, 2 tasks on 2
nodes, `--launcher none`): preemption signals, a crashed task, the restart budget, a data
error and the time limit, with and without a warning signal.

Every job that completes must end with a model bitwise equal to one uninterrupted local run
of the same config and world size (`reference_model`). PYRECOVER_STEP_DELAY slows the steps
down so a run can be caught mid-way; it does not change what is computed.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from localslurm import TERMINAL_STATES, LocalSlurm

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "launch" / "clusters" / "local.yaml"
TINY = REPO / "launch" / "experiments" / "tiny.yaml"
MAX_STEPS = 20
INTERVAL = 5
SETS = ("model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
        f"train.max_steps={MAX_STEPS}", "train.global_batch_size=8",
        "train.micro_batch_size=2", "train.log_interval=1", f"checkpoint.interval={INTERVAL}")
WORLD = ("--nodes", "2", "--gpus-per-node", "1", "--launcher", "none")
# The jobs' tasks and the local reference runs compute with the same CPU threads per rank
# (dist.cpu_threads): a task alone on its node would take every core, a reference's rank
# half of them, and their reductions would differ in the last bits (seen on an Intel Xeon VM).
SAME_THREADS = {"OMP_NUM_THREADS": "1"}


# ------------------------------------------------------------------------------ fixtures



@pytest.fixture(scope="module")
def reference_model(corpus: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> dict[str, torch.Tensor]:
    """The final weights of one uninterrupted local run: same config, world size 2."""
    return reference_run(corpus, tmp_path_factory.mktemp("reference"), 2)


@pytest.fixture(scope="module", autouse=True)
def time_limit_runs(request: pytest.FixtureRequest, local_slurm: LocalSlurm, corpus: Path,
                    tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[dict[str, tuple[int, Path]]]:
    """The two time-limit jobs, submitted as the module starts so that their minutes of
    waiting for the limit overlap each other and the module's other tests (each job takes
    one of a node's four CPUs): 20 steps x 5 s, about 100 s of training, in 2-minute jobs;
    `signal` gets USR2 60-90 s before the limit and may not requeue after a failure
    (max_restarts 0: clean stops do not count), `deadline` no signal. (job id, run
    directory) by name; both are cancelled when the module ends. Nothing is submitted where
    no selected test asks for them by name (`pytest -k` of another test)."""
    wanted = any("time_limit_runs" in inspect.signature(item.function).parameters
                 for item in request.session.items if item.module is request.module)
    if not wanted:
        yield {}
        return
    ids: list[int] = []
    try:
        yield {name: launch(local_slurm, ids, tmp_path_factory.mktemp(name), name, corpus,
                            "--time", "2", "--signal-seconds", seconds, "--max-restarts",
                            restarts, env={"PYRECOVER_STEP_DELAY": "5"})
               for name, seconds, restarts in (("signal", "60", "0"), ("deadline", "0", "8"))}
    finally:
        for job_id in ids:
            local_slurm.cancel(str(job_id))


def reference_run(corpus: Path, storage: Path, nproc: int) -> dict[str, torch.Tensor]:
    """The final weights of `train --nproc NPROC` of the tiny run, uninterrupted, here."""
    argv = [sys.executable, "-m", "pyrecover", "train", "--nproc", str(nproc), "--config",
            str(TINY), "--set", f"data.path={corpus}", "--set", f"run.storage={storage}",
            "--set", "run.exp_name=reference"]
    for item in SETS:
        argv += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    env.update(SAME_THREADS)
    done = subprocess.run(argv, env=env, cwd=storage, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return export_model(storage / "reference", env)


# ------------------------------------------------------------------------------- helpers


def launch_env(cluster: LocalSlurm, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What the launch sees and sbatch exports to the job: the venv first on PATH,
    SLURM_CONF, and the PYRECOVER_* fault and timing knobs of the test."""
    env = {k: v for k, v in cluster.client_env().items() if not k.startswith("PYRECOVER_")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env["PATH"]])
    env.update(SAME_THREADS)
    env.update(extra or {})
    return env


def launch(cluster: LocalSlurm, jobs: list[int], tmp_path: Path, name: str, data: Path,
           *args: str, env: dict[str, str] | None = None) -> tuple[int, Path]:
    """`pyrecover launch` the tiny run at world size 2; return (job id, run directory)."""
    storage = tmp_path / "storage"
    argv = [sys.executable, "-m", "pyrecover", "launch", "--config", str(TINY),
            "--cluster", str(LOCAL), *WORLD, "--exp-name", name,
            "--set", f"run.storage={storage}", "--set", f"data.path={data}"]
    for item in SETS:
        argv += ["--set", item]
    done = subprocess.run([*argv, *args], env=launch_env(cluster, env), cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    match = re.search(r"^submitted job (\d+)$", done.stdout, re.M)
    assert match, done.stdout
    jobs.append(int(match.group(1)))
    return int(match.group(1)), storage / name


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def kinds(run_dir: Path) -> list[str]:
    """The run's lifecycle events in order, without the checkpoint chatter."""
    keep = {"start", "resume", "stop", "crash", "error", "requeue", "no_requeue", "finish"}
    return [e["event"] for e in events(run_dir) if e["event"] in keep]


def last_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    steps = [json.loads(line).get("step", 0) for line in path.read_text().splitlines()
             if line.strip().endswith("}")]
    return max(steps, default=0)


def explain(run_dir: Path, job_id: int) -> str:
    """The job's log and events, for an assertion message."""
    log = run_dir / "logs" / f"{job_id}.out"
    text = log.read_text()[-6000:] if log.exists() else "(no log)"
    return f"--- log\n{text}\n--- events\n" + "\n".join(map(json.dumps, events(run_dir)))


def wait_for(check: Callable[[], bool], timeout: float, what: str, detail: Callable[[], str]
             ) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout:.0f}s\n{detail()}")
        time.sleep(0.5)


def running_at_step(cluster: LocalSlurm, job_id: int, run_dir: Path, step: int,
                    after: int = 0) -> bool:
    """Whether the job is RUNNING and metrics.jsonl shows `step` in an attempt that began
    after `after` lifecycle events (so a resumed run's own progress counts, not old lines);
    a job that already ended fails the test."""
    state = cluster.job_state(job_id)
    assert state not in TERMINAL_STATES, f"job ended early: {state}\n" + explain(run_dir, job_id)
    return state == "RUNNING" and len(kinds(run_dir)) > after and last_step(run_dir) >= step


def wait_running_at_step(cluster: LocalSlurm, job_id: int, run_dir: Path, step: int,
                         after: int = 0) -> None:
    wait_for(lambda: running_at_step(cluster, job_id, run_dir, step, after), 240,
             f"job {job_id} at step {step}", lambda: explain(run_dir, job_id))


def wait_end(cluster: LocalSlurm, job_id: int, run_dir: Path, timeout: float) -> dict[str, str]:
    try:
        cluster.wait_job(job_id, timeout=timeout, poll=1.0)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{explain(run_dir, job_id)}") from None
    return cluster.job_info(job_id)


def status(cluster: LocalSlurm, run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "pyrecover", "status", str(run_dir), "--json"],
                          env=launch_env(cluster), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def export_model(run_dir: Path, env: dict[str, str]) -> dict[str, torch.Tensor]:
    out = run_dir.parent / f"{run_dir.name}-final.pt"
    done = subprocess.run([sys.executable, "-m", "pyrecover", "ckpt", "export", str(run_dir),
                           "--out", str(out)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return torch.load(out, weights_only=True)


def assert_same_model(cluster: LocalSlurm, run_dir: Path, reference: dict[str, torch.Tensor]
                      ) -> None:
    model = export_model(run_dir, launch_env(cluster))
    assert model.keys() == reference.keys()
    different = [k for k in model if not torch.equal(model[k], reference[k])]
    assert not different, f"tensors differ from the uninterrupted run: {different}"


def assert_completed(cluster: LocalSlurm, job_id: int, run_dir: Path, info: dict[str, str]
                     ) -> dict:
    """The job completed at max_steps after at least one requeue; returns its status."""
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert int(info["Restarts"]) >= 1
    finished = [e["step"] for e in events(run_dir) if e["event"] == "finish"]
    assert finished == [MAX_STEPS], explain(run_dir, job_id)
    report = status(cluster, run_dir)
    assert report["state"] == "finished" and report["step"] == MAX_STEPS
    assert report["last_checkpoint"]["step"] == MAX_STEPS
    assert report["job_id"] == str(job_id)
    assert all(d["event"] == "requeue" for d in report["requeue_decisions"])
    assert len(report["requeue_decisions"]) == int(info["Restarts"])
    return report


# --------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("signal, to", [("USR2", "full"), ("USR2", "batch"), ("TERM", None),
                                        ("TERM", "batch")])
def test_a_preempted_job_saves_requeues_resumes_and_ends_with_the_uninterrupted_model(
        local_slurm, jobs, corpus, reference_model, tmp_path, signal, to):
    job_id, run_dir = launch(local_slurm, jobs, tmp_path, f"preempt-{signal.lower()}-{to}",
                             corpus, env={"PYRECOVER_STEP_DELAY": "1"})
    wait_running_at_step(local_slurm, job_id, run_dir, 4)
    # USR2 as `scancel --signal=USR2 --full` sends it: to the batch shell too, which must
    # survive it to requeue the job. `--batch`: to the batch shell alone, which must pass it
    # on to the training step (it did not, and the job trained on to its end). SIGTERM to the
    # batch shell alone is a preemption notice too (it was only logged).
    local_slurm.run("scancel", f"--signal={signal}", *([f"--{to}"] if to else []),
                    str(job_id))
    info = wait_end(local_slurm, job_id, run_dir, timeout=300)

    report = assert_completed(local_slurm, job_id, run_dir, info)
    assert info["Restarts"] == "1"
    assert kinds(run_dir) == ["start", "stop", "requeue", "resume", "finish"], \
        explain(run_dir, job_id)
    every = events(run_dir)
    stop = next(e for e in every if e["event"] == "stop")
    resume = next(e for e in every if e["event"] == "resume")
    requeue = next(e for e in every if e["event"] == "requeue")
    assert stop["reason"] == f"SIG{signal}"
    assert 4 <= stop["step"] < MAX_STEPS
    assert (requeue["exit_code"], requeue["reason"]) == (75, "stopped cleanly")
    assert resume["step"] == stop["step"] and resume["steps_lost"] == 0  # saved at the stop
    assert report["restarts_by_cause"] == {f"stop (SIG{signal})": 1}
    assert report["steps_lost"] == 0
    assert_same_model(local_slurm, run_dir, reference_model)


def test_a_killed_task_fails_the_step_and_the_job_resumes_from_the_last_checkpoint(
        local_slurm, jobs, corpus, reference_model, tmp_path):
    job_id, run_dir = launch(local_slurm, jobs, tmp_path, "crash", corpus, env={
        "PYRECOVER_KILL_AT_STEP": "7", "PYRECOVER_KILL_RANK": "1",
        "PYRECOVER_KILL_TARGET": "self", "PYRECOVER_KILL_ONCE": str(tmp_path / "killed-once")})
    info = wait_end(local_slurm, job_id, run_dir, timeout=300)

    report = assert_completed(local_slurm, job_id, run_dir, info)
    assert (tmp_path / "killed-once").exists()
    assert info["Restarts"] == "1"
    every = events(run_dir)
    [requeue] = [e for e in every if e["event"] == "requeue"]
    assert requeue["reason"] == "crash" and requeue["exit_code"] not in (0, 2, 75)
    [resume] = [e for e in every if e["event"] == "resume"]
    # Killed right after step 7: the newest committed checkpoint is step 5, and rank 0 had
    # logged steps 6 and 7, which are redone.
    assert resume["step"] == INTERVAL and resume["steps_lost"] == 2, explain(run_dir, job_id)
    assert "stop" not in kinds(run_dir)
    assert sum(report["restarts_by_cause"].values()) == 1
    assert set(report["restarts_by_cause"]) <= {"crash", "killed (no record)"}
    assert report["steps_lost"] == 2
    assert_same_model(local_slurm, run_dir, reference_model)


def test_the_interruption_after_max_restarts_is_not_requeued_and_status_says_why(
        local_slurm, jobs, corpus, tmp_path):
    # No once-guard: the resumed run redoes step 7 and is killed there again.
    job_id, run_dir = launch(local_slurm, jobs, tmp_path, "budget", corpus, "--max-restarts",
                             "1", env={"PYRECOVER_KILL_AT_STEP": "7",
                                       "PYRECOVER_KILL_RANK": "1",
                                       "PYRECOVER_KILL_TARGET": "self"})
    info = wait_end(local_slurm, job_id, run_dir, timeout=300)

    assert info["JobState"] != "COMPLETED" and info["Restarts"] == "1", explain(run_dir, job_id)
    decisions = [e for e in events(run_dir) if e["event"] in ("requeue", "no_requeue")]
    assert [(d["event"], d["restart_count"]) for d in decisions] == [
        ("requeue", 0), ("no_requeue", 1)], explain(run_dir, job_id)
    assert decisions[1]["reason"] == "crash; max restarts (1) reached by failures"
    assert "finish" not in kinds(run_dir)
    report = status(local_slurm, run_dir)
    assert report["state"] == "ended: crash; max restarts (1) reached by failures"
    assert [d["event"] for d in report["requeue_decisions"]] == ["requeue", "no_requeue"]
    assert "max restarts" in report["requeue_decisions"][-1]["reason"]
    assert report["last_checkpoint"]["step"] == INTERVAL
    assert report["step"] == 7 and report["steps_lost"] == 2
    assert sum(report["restarts_by_cause"].values()) == 1


def test_a_data_error_in_the_job_exits_2_and_is_not_requeued(local_slurm, jobs, tmp_path):
    # `pyrecover launch` only warns about a data file it cannot see (it may exist only on
    # the cluster); the trainer in the job finds it missing and exits 2.
    missing = tmp_path / "nowhere" / "corpus.parquet"
    job_id, run_dir = launch(local_slurm, jobs, tmp_path, "data-error", missing,
                             "--max-restarts", "1")
    info = wait_end(local_slurm, job_id, run_dir, timeout=240)

    assert info["JobState"] == "FAILED", explain(run_dir, job_id)
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"error: data file {str(missing)!r} does not exist" in log
    report = status(local_slurm, run_dir)
    assert report["last_error"] and str(missing) in report["last_error"], report
    assert report["restarts_by_cause"] == {} and report["last_checkpoint"] is None
    decisions = [e for e in events(run_dir) if e["event"] in ("requeue", "no_requeue")]
    # srun may return a SIGTERMed peer's 143 rather than the failing rank's 2; the script
    # then finds this attempt's `error` event and still does not requeue.
    assert [(d["event"], d["exit_code"], d["reason"]) for d in decisions] == [
        ("no_requeue", 2, "config, data or training error")]
    assert (info["ExitCode"], info["Restarts"]) == ("2:0", "0")
    assert report["state"] == "ended: config, data or training error"


def test_a_run_longer_than_the_time_limit_stops_on_the_warning_signal_and_completes(
        local_slurm, time_limit_runs, reference_model):
    job_id, run_dir = time_limit_runs["signal"]
    assert "#SBATCH --signal=USR2@60" in (run_dir / "job.sbatch").read_text()
    assert "MAX_RESTARTS=0 " in (run_dir / "job.sbatch").read_text()
    info = wait_end(local_slurm, job_id, run_dir, timeout=900)

    # Requeued at each limit although max_restarts is 0: clean stops are no failures.
    report = assert_completed(local_slurm, job_id, run_dir, info)
    stops = [e for e in events(run_dir) if e["event"] == "stop"]
    assert stops and stops[0]["reason"] == "SIGUSR2", explain(run_dir, job_id)
    assert {s["reason"] for s in stops} <= {"SIGUSR2", "deadline"}
    assert len(stops) == int(info["Restarts"])
    assert sum(report["restarts_by_cause"].values()) == len(stops)
    assert report["steps_lost"] == 0
    assert_same_model(local_slurm, run_dir, reference_model)


def test_without_a_warning_signal_the_trainer_stops_on_its_deadline_and_completes(
        local_slurm, time_limit_runs, reference_model):
    job_id, run_dir = time_limit_runs["deadline"]
    assert "#SBATCH --signal" not in (run_dir / "job.sbatch").read_text()  # no warning
    info = wait_end(local_slurm, job_id, run_dir, timeout=900)

    report = assert_completed(local_slurm, job_id, run_dir, info)
    stops = [e for e in events(run_dir) if e["event"] == "stop"]
    assert stops and {s["reason"] for s in stops} == {"deadline"}, explain(run_dir, job_id)
    assert len(stops) == int(info["Restarts"])
    assert report["restarts_by_cause"] == {"time limit": len(stops)}
    assert report["steps_lost"] == 0
    assert_same_model(local_slurm, run_dir, reference_model)


def test_pyrecover_cancel_ends_the_job_for_good_after_it_saves_its_stop_checkpoint(
        local_slurm, jobs, corpus, tmp_path):
    """A plain scancel is a preemption to the job script (it requeues); `pyrecover cancel`
    makes the job non-requeueable first: the trainer still stops and saves, and the job
    ends, with no requeue. Launched again, the run's restart is counted as `cancelled` (it
    was `stop (SIGTERM)`, as a preemption's)."""
    job_id, run_dir = launch(local_slurm, jobs, tmp_path, "cancel", corpus,
                             env={"PYRECOVER_STEP_DELAY": "0.5"})
    wait_running_at_step(local_slurm, job_id, run_dir, 3)
    argv = [sys.executable, "-m", "pyrecover", "cancel", str(run_dir)]
    done = subprocess.run(argv, env=launch_env(local_slurm), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"cancelled job {job_id} (RUNNING)" in done.stderr
    info = wait_end(local_slurm, job_id, run_dir, timeout=300)

    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), explain(run_dir, job_id)
    every = events(run_dir)
    assert not [e for e in every if e["event"] in ("requeue", "resume")], explain(run_dir, job_id)
    [stop] = [e for e in every if e["event"] == "stop"]
    assert stop["reason"] == "SIGTERM" and stop["step"] < MAX_STEPS
    assert status(local_slurm, run_dir)["last_checkpoint"]["step"] == stop["step"]
    again = subprocess.run(argv, env=launch_env(local_slurm), capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 2 and "nothing to cancel" in again.stderr, again.stderr
    assert again.stderr.count("\n") == 1  # one line, no traceback
    job_id, _ = launch(local_slurm, jobs, tmp_path, "cancel", corpus)  # the user resumes it
    assert wait_end(local_slurm, job_id, run_dir, timeout=300)["JobState"] == "COMPLETED"
    assert status(local_slurm, run_dir)["restarts_by_cause"] == {"cancelled": 1}
