"""Launching as a new user types it, and a clean stop under every launcher, on the real local
SLURM cluster: the headline `pyrecover launch --nodes 2 --mode dcp` with a profile written by
`--init-cluster` and no experiment file; `--launcher torchrun` and `--launcher spawn` stopped
by `scancel --signal=USR2` mid-run, requeued, resumed, and ending bitwise equal to an
uninterrupted local run of the same world size.

The helpers and the world-size-2 reference come from test_requeue_e2e.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from localslurm import LocalSlurm
from test_requeue_e2e import (
    MAX_STEPS,
    assert_completed,
    assert_same_model,
    events,
    explain,
    kinds,
    launch,
    launch_env,
    reference_run,
    running_at_step,
    wait_end,
    wait_for,
)

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory):
    """reference(n): the final weights of `train --nproc n` of the same run, uninterrupted."""
    models: dict[int, dict[str, torch.Tensor]] = {}

    def get(nproc: int) -> dict[str, torch.Tensor]:
        if nproc not in models:
            models[nproc] = reference_run(corpus, tmp_path_factory.mktemp("reference"), nproc)
        return models[nproc]
    return get


def test_the_headline_command_runs_the_demo_with_a_profile_from_init_cluster(
        local_slurm, jobs, corpus, tmp_path):
    # A new user's machine: a home without a profile, the demo's corpus where the demo
    # experiment looks for it (runs/stdlib.parquet), no experiment file.
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "runs").mkdir()
    shutil.copy(corpus, tmp_path / "runs" / "stdlib.parquet")
    env = launch_env(local_slurm, {"HOME": str(home)})

    def pyrecover(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "pyrecover", *args], env=env, cwd=tmp_path,
                              capture_output=True, text=True, timeout=60)

    profile = home / ".config" / "pyrecover" / "cluster.yaml"
    done = pyrecover("launch", "--init-cluster", str(profile))
    assert done.returncode == 0 and "from sinfo" in done.stdout, done.stderr
    written = profile.read_text()
    assert "partition: debug" in written and "gpus_per_node: 4" in written

    # The demo's 300 steps would take minutes at 8 ranks on 2 cores; 30 show the same.
    done = pyrecover("launch", "--nodes", "2", "--mode", "dcp", "--launcher", "none",
                     "--set", "train.max_steps=30")
    assert done.returncode == 0, done.stderr
    assert "note: train.global_batch_size=auto:16: 64 sequences chosen for world size x " \
           "train.micro_batch_size (8 x 8 = 64)" in done.stderr
    job_id = int(done.stdout.split("submitted job ")[1].split()[0])
    jobs.append(job_id)
    run_dir = tmp_path / "runs" / "demo"
    info = wait_end(local_slurm, job_id, run_dir, timeout=600)

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert (info["NumNodes"], info["NumTasks"], info["Partition"]) == ("2", "8", "debug")
    every = events(run_dir)
    start = next(e for e in every if e["event"] == "start")
    assert (start["world_size"], start["mode"]) == (8, "dcp")
    assert [e["step"] for e in every if e["event"] == "finish"] == [30]
    manifest = json.loads((run_dir / "checkpoints" / "step-30" / "manifest.json").read_text())
    assert manifest["mode"] == "dcp"
    recorded = (run_dir / "run.yaml").read_text()
    assert recorded.startswith("# train.global_batch_size=auto:16: 64 sequences chosen")
    assert "global_batch_size: 64" in recorded


LAUNCHERS = {"torchrun": "1", "spawn": "2"}  # launcher: tasks (GPUs) per node


@pytest.fixture(scope="module")
def usr2_runs(local_slurm: LocalSlurm, corpus: Path, tmp_path_factory: pytest.TempPathFactory
              ) -> Iterator[dict[str, tuple[int, Path]]]:
    """One job per launcher, submitted together (the cluster has room for both) so their
    requeues overlap, each sent USR2 as soon as it is at step 4; (job id, run directory) by
    launcher, both cancelled when the module ends."""
    ids: list[int] = []
    try:
        runs = {name: launch(local_slurm, ids, tmp_path_factory.mktemp(name), f"usr2-{name}",
                             corpus, "--launcher", name, "--gpus-per-node", per_node,
                             env={"PYRECOVER_STEP_DELAY": "1"})
                for name, per_node in LAUNCHERS.items()}
        pending = dict(runs)

        def signal_those_at_step_4() -> bool:  # each as soon as it is there, in any order
            for name, (job_id, run_dir) in list(pending.items()):
                if running_at_step(local_slurm, job_id, run_dir, 4):
                    local_slurm.run("scancel", "--signal=USR2", str(job_id))
                    del pending[name]
            return not pending

        wait_for(signal_those_at_step_4, 240, "both jobs at step 4",
                 lambda: "\n".join(explain(run_dir, job_id)
                                   for job_id, run_dir in pending.values()))
        yield runs
    finally:
        for job_id in ids:
            local_slurm.cancel(str(job_id))


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_usr2_under_torchrun_and_spawn_stops_requeues_and_resumes_to_the_same_model(
        local_slurm, usr2_runs, reference, launcher):
    job_id, run_dir = usr2_runs[launcher]
    info = wait_end(local_slurm, job_id, run_dir, timeout=400)

    assert_completed(local_slurm, job_id, run_dir, info)
    assert info["Restarts"] == "1"
    assert kinds(run_dir) == ["start", "stop", "requeue", "resume", "finish"], \
        explain(run_dir, job_id)
    every = events(run_dir)
    stop = next(e for e in every if e["event"] == "stop")
    requeue = next(e for e in every if e["event"] == "requeue")
    resume = next(e for e in every if e["event"] == "resume")
    assert stop["reason"] == "SIGUSR2" and 4 <= stop["step"] < MAX_STEPS
    assert (requeue["exit_code"], requeue["reason"]) == (75, "stopped cleanly")
    assert resume["step"] == stop["step"] and resume["steps_lost"] == 0
    world = 2 * int(LAUNCHERS[launcher])
    assert next(e for e in every if e["event"] == "start")["world_size"] == world
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert f"world size {world} ({launcher})" in log
    assert_same_model(local_slurm, run_dir, reference(world))
