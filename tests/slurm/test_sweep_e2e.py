"""A sweep on a real local SLURM cluster: a 2 x 2 grid (learning rate x seed) on the tiny
config as one job array with at most 2 trials at once, each trial at world size 1 with
`--launcher none`. One trial is preempted with SIGUSR2 mid-run: it alone saves, requeues as
its own array task and resumes, ending with the model of the same trial run uninterrupted;
the other trials run once, untouched. `sweep status` ranks the trials by their final loss.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from localslurm import TERMINAL_STATES, LocalSlurm
from test_requeue_e2e import (
    LOCAL,
    MAX_STEPS,
    SETS,
    TINY,
    events,
    export_model,
    kinds,
    last_step,
    launch_env,
    wait_for,
)

pytestmark = pytest.mark.slurm

SWEEP = """\
name: lr-seed
method: grid
metric: {name: loss, goal: minimize}
max_parallel: 2
parameters:
  train.lr: {values: [1e-3, 3e-3]}
  train.seed: {values: [1, 2]}
"""
PREEMPTED = 1


def sweep_launch_argv(sweep_file: Path, storage: Path, corpus: Path, sets) -> list[str]:
    """`pyrecover sweep launch` of `sweep_file` on the tiny config, one task per trial."""
    argv = [sys.executable, "-m", "pyrecover", "sweep", "launch", str(sweep_file),
            "--config", str(TINY), "--cluster", str(LOCAL), "--nodes", "1",
            "--gpus-per-node", "1", "--launcher", "none",
            "--set", f"run.storage={storage}", "--set", f"data.path={corpus}"]
    for item in sets:
        argv += ["--set", item]
    return argv


def launch_sweep(local_slurm: LocalSlurm, tmp_path: Path, corpus: Path, text: str
                 ) -> tuple[list[str], dict[str, str], str]:
    """launch_sweep writes `text` to sweep.yaml and launches it into tmp_path/storage with a
    0.5 s step; returns the argv, the environment and what the launch printed."""
    (tmp_path / "sweep.yaml").write_text(text)
    argv = sweep_launch_argv(tmp_path / "sweep.yaml", tmp_path / "storage", corpus, SETS)
    env = launch_env(local_slurm, {"PYRECOVER_STEP_DELAY": "0.5"})
    done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return argv, env, done.stdout


def explain(sweep_dir: Path) -> str:
    parts = []
    for trial in sorted(sweep_dir.glob("trial-*")):
        logs = sorted((trial / "logs").glob("*.out"))
        tail = "".join(log.read_text()[-1500:] for log in logs) or "(no log)"
        parts.append(f"--- {trial.name}: {kinds(trial)}\n{tail}")
    return "\n".join(parts)


def test_a_grid_sweep_runs_as_one_array_and_a_preempted_trial_requeues_alone(
        local_slurm: LocalSlurm, corpus: Path, tmp_path: Path):
    argv, env, said = launch_sweep(local_slurm, tmp_path, corpus, SWEEP)
    storage = tmp_path / "storage"
    match = re.search(r"^submitted job array (\d+) \(4 trials\)", said, re.M)
    assert match, said
    array = int(match.group(1))
    sweep_dir = storage / "lr-seed"
    tasks = [f"{array}_{i}" for i in range(4)]
    try:
        # At most 2 at once: while the first two run, the others wait.
        preempted = sweep_dir / f"trial-{PREEMPTED}"
        wait_for(lambda: local_slurm.job_state(tasks[PREEMPTED]) == "RUNNING"
                 and last_step(preempted) >= 4, 240, "trial 1 at step 4",
                 lambda: explain(sweep_dir))
        queued = local_slurm.run("squeue", "-h", "-r", "-j", str(array), "-o", "%i %T").stdout
        assert sum(" RUNNING" in line for line in queued.splitlines()) <= 2, queued
        preempt_and_finish(local_slurm, tasks, PREEMPTED, sweep_dir)
    finally:
        local_slurm.cancel(str(array))

    for i, task in enumerate(tasks):
        info = local_slurm.job_info(task)
        trial = sweep_dir / f"trial-{i}"
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(sweep_dir)
        if i == PREEMPTED:
            assert info["Restarts"] == "1"
            assert kinds(trial) == ["start", "stop", "requeue", "resume", "finish"], \
                explain(sweep_dir)
        else:
            assert info["Restarts"] == "0"
            assert kinds(trial) == ["start", "finish"], explain(sweep_dir)
        assert [e["step"] for e in events(trial) if e["event"] == "finish"] == [MAX_STEPS]

    report = sweep_status(sweep_dir, env)
    finals = {t["index"]: t["last"] for t in report["trials"]}
    assert [t["index"] for t in report["trials"]] == sorted(finals, key=finals.__getitem__)
    assert report["best"] == report["trials"][0]["index"]
    assert {t["index"]: t["restarts"] for t in report["trials"]} == {0: 0, 1: 1, 2: 0, 3: 0}
    assert {t["state"] for t in report["trials"]} == {"finished"}
    assert {t["slurm_state"] for t in report["trials"]} == {"COMPLETED"}
    assert {(t["params"]["train.lr"], t["params"]["train.seed"]) for t in report["trials"]} == {
        (0.001, 1), (0.001, 2), (0.003, 1), (0.003, 2)}

    # One task holds the array's own record and has the array's id as its SLURM_JOB_ID: that is
    # why a task requeues itself as ARRAYID_TASKID, and status asks SLURM about that name.
    starts = {i: next(e for e in events(sweep_dir / f"trial-{i}") if e["event"] == "start")
              for i in range(4)}
    assert {s["array_task"] for s in starts.values()} == set(tasks)
    assert str(array) in {s["job_id"] for s in starts.values()}
    for i in range(4):
        done = subprocess.run([sys.executable, "-m", "pyrecover", "status",
                               str(sweep_dir / f"trial-{i}"), "--json"], env=env,
                              capture_output=True, text=True, timeout=60)
        assert json.loads(done.stdout)["slurm_state"] == "COMPLETED", done.stderr

    # The preempted trial ends with the model of its own config run without interruption.
    clean = {k: v for k, v in env.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    reference = tmp_path / "reference"
    done = subprocess.run([sys.executable, "-m", "pyrecover", "train", "--config",
                           str(preempted / "run.yaml"), "--run-dir", str(reference)],
                          env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    model, expected = export_model(preempted, clean), export_model(reference, clean)
    assert model.keys() == expected.keys()
    assert all(torch.equal(model[k], expected[k]) for k in model)


def preempt_and_finish(cluster: LocalSlurm, tasks: list[str], preempted: int,
                       sweep_dir: Path) -> None:
    """preempt_and_finish sends USR2 to trial `preempted`'s training step, then waits until
    every array task has ended and every trial recorded its finish.

    The step is signalled, not the task: on SLURM 22.05, `scancel --signal` of an array task
    gets "Job can not be altered now" back and retries (signalling again) until it ends."""
    step = f"{cluster.job_info(tasks[preempted])['JobId']}.0"
    cluster.run("scancel", "--signal=USR2", step)

    def all_ended() -> bool:
        return all(cluster.job_state(t) in TERMINAL_STATES for t in tasks) and all(
            "finish" in kinds(sweep_dir / f"trial-{i}") for i in range(len(tasks)))
    wait_for(all_ended, 600, "every trial finished", lambda: explain(sweep_dir))


def sweep_status(sweep_dir: Path, env: dict[str, str]) -> dict:
    """sweep_status is `pyrecover sweep status SWEEP_DIR --json`, which must succeed."""
    done = subprocess.run([sys.executable, "-m", "pyrecover", "sweep", "status",
                           str(sweep_dir), "--json"], env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_sweep_is_cancelled_for_good_and_so_is_one_trial_still_in_the_queue(
        local_slurm: LocalSlurm, corpus: Path, tmp_path: Path):
    """A plain `scancel` of the array is taken for a preemption: each running trial saves and
    requeues itself. `pyrecover cancel TRIAL_DIR` ends one trial that is still waiting (no
    event of its own names its task yet), and `pyrecover cancel SWEEP_DIR` ends every task for
    good: the running trial saves at its next step and is not requeued, the waiting ones never
    start. A second launch while the array is queued names that command."""
    argv, env, said = launch_sweep(local_slurm, tmp_path, corpus, SWEEP.replace(
        "lr-seed", "ended").replace("max_parallel: 2", "max_parallel: 1"))
    storage = tmp_path / "storage"
    array = int(re.search(r"^submitted job array (\d+) ", said, re.M).group(1))
    sweep_dir = storage / "ended"
    tasks = [f"{array}_{i}" for i in range(4)]

    def cancel(path: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pyrecover", "cancel", str(path)],
                              env=env, capture_output=True, text=True, timeout=60)
    try:
        wait_for(lambda: local_slurm.job_state(tasks[0]) == "RUNNING"
                 and last_step(sweep_dir / "trial-0") >= 2, 240, "trial 0 at step 2",
                 lambda: explain(sweep_dir))
        again = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                               timeout=60)
        assert again.returncode == 2, again.stderr
        assert again.stderr.splitlines()[-1].endswith(
            f"wait for it (pyrecover sweep status {sweep_dir}) or end it for good with "
            f"`pyrecover cancel {sweep_dir}`"), again.stderr

        one = cancel(sweep_dir / "trial-3")
        assert one.returncode == 0, one.stderr
        assert f"cancelled job {array}_3 (PENDING): it was waiting in the queue" in one.stderr
        assert local_slurm.wait_job(tasks[3], timeout=60) == "CANCELLED"
        assert local_slurm.job_state(tasks[0]) == "RUNNING"

        every = cancel(sweep_dir)
        assert every.returncode == 0, every.stderr
        assert every.stderr.startswith(f"cancelled job array {array}: trial-0 (RUNNING) saves"), \
            every.stderr
        wait_for(lambda: all(local_slurm.job_state(t) in TERMINAL_STATES for t in tasks), 120,
                 "every task ended", lambda: explain(sweep_dir))
    finally:
        local_slurm.cancel(str(array))

    assert {local_slurm.job_state(t) for t in tasks} == {"CANCELLED"}
    assert local_slurm.job_info(tasks[0])["Restarts"] == "0"
    assert kinds(sweep_dir / "trial-0") == ["start", "stop", "no_requeue"], explain(sweep_dir)
    assert [kinds(sweep_dir / f"trial-{i}") for i in (1, 2, 3)] == [[], [], []]
    states = {t["index"]: t["state"] for t in sweep_status(sweep_dir, env)["trials"]}
    assert states == {0: "ended: cancelled; the job may not requeue", 1: "cancelled",
                      2: "cancelled", 3: "cancelled"}
