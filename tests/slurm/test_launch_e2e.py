"""`pyrecover launch` on a real local SLURM cluster: the rendered job runs 4 ranks on 2 nodes
as one gloo process group, trains on CPU, checkpoints into the run directory and completes,
with each launcher (srun in a container, torchrun in a container, none).

The container is tests/bin/apptainer, a bubblewrap stand-in for apptainer (no apptainer can
be installed here). It honours `--bind`: the corpus is bound at a path that exists only
inside the container, so a job that did not run in the container cannot find its data.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from localslurm import LocalSlurm

from pyrecover.rundir import RunDir
from pyrecover.runlock import RunLock
from pyrecover.spawn import free_port

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[2]
LOCAL = REPO / "launch" / "clusters" / "local.yaml"
TINY = REPO / "launch" / "experiments" / "tiny.yaml"
IN_CONTAINER_DATA = "/pyrecover-e2e-data"  # exists only inside the stand-in container
SECRET = "e2e-wandb-secret-5f0c1d"
JOB_TIMEOUT = 150
TINY_SETS = ("model.n_layer=2", "model.n_embd=64", "model.n_head=2", "model.block_size=64",
             "train.max_steps=20", "train.global_batch_size=8", "train.micro_batch_size=2",
             "train.log_interval=5", "checkpoint.interval=10")



def launch_env(cluster: LocalSlurm) -> dict[str, str]:
    """What the launch sees, and so what sbatch exports to the job: tests/bin (the apptainer
    stand-in) and the venv first on PATH, SLURM_CONF, and a secret that must not be written."""
    env = cluster.client_env({"WANDB_API_KEY": SECRET})
    env["PATH"] = os.pathsep.join([str(REPO / "tests" / "bin"), str(Path(sys.executable).parent),
                                   env["PATH"]])
    return env


def launch(cluster: LocalSlurm, cwd: Path, *args: str, conf: Path | None = None
           ) -> subprocess.CompletedProcess:
    """`pyrecover launch` of the tiny run on `cluster` (or as `conf`, a slurm.conf, says)."""
    argv = [sys.executable, "-m", "pyrecover", "launch", "--config", str(TINY),
            "--cluster", str(LOCAL), "--nodes", "2", "--gpus-per-node", "2"]
    for item in TINY_SETS:
        argv += ["--set", item]
    env = launch_env(cluster) | ({"SLURM_CONF": str(conf)} if conf else {})
    return subprocess.run([*argv, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def submitted_job(done: subprocess.CompletedProcess) -> int:
    assert done.returncode == 0, done.stderr
    match = re.search(r"^submitted job (\d+)$", done.stdout, re.M)
    assert match, done.stdout
    return int(match.group(1))


def run_job(cluster: LocalSlurm, tmp_path: Path, name: str, storage: Path, *args: str):
    """Launch, wait for the job to end; return (job id, run dir, scontrol record, log text)."""
    done = launch(cluster, tmp_path, "--exp-name", name, "--set", f"run.storage={storage}",
                  *args)
    job_id = submitted_job(done)
    run_dir = storage / name
    assert f"run directory: {run_dir}" in done.stdout
    assert "follow the log: tail -F " in done.stdout and f"{job_id}.out" in done.stdout
    log = run_dir / "logs" / f"{job_id}.out"
    try:
        state = cluster.wait_job(job_id, timeout=JOB_TIMEOUT)
    finally:
        text = log.read_text() if log.exists() else "(no log)"
    assert state == "COMPLETED", text
    return job_id, run_dir, cluster.job_info(job_id), text


def check_trained_run(run_dir: Path, job_id: int, info: dict[str, str], log: str,
                      launcher: str) -> None:
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    assert (info["NumNodes"], info["NumTasks"], info["NodeList"]) == ("2", "4", "node[1-2]")
    assert info["Partition"] == "debug" and info["Requeue"] == "1"
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    start = next(e for e in events if e["event"] == "start")
    assert start["world_size"] == 4 and start["job_id"] == str(job_id)
    assert [e["step"] for e in events if e["event"] == "finish"] == [20]
    for step in (10, 20):
        assert (run_dir / "checkpoints" / f"step-{step}" / "manifest.json").is_file()
    assert f"world size 4 ({launcher})" in log
    assert "finished at step 20" in log
    assert "training exited with code 0" in log
    script = (run_dir / "job.sbatch").read_text()
    assert script.startswith("#!/bin/bash\n") and "#SBATCH --requeue" in script
    assert SECRET not in script
    assert SECRET not in (run_dir / "run.yaml").read_text()


def test_srun_runs_four_ranks_in_the_container_with_storage_bind_mounted(
        local_slurm, corpus, tmp_path):
    # Quotes and spaces in the storage path go through sbatch, srun and the bind as they are.
    storage = tmp_path / "st ore 'q'"
    (tmp_path / "pyrecover.sif").write_text("the stand-in ignores the image's contents\n")
    job_id, run_dir, info, log = run_job(
        local_slurm, tmp_path, "e2e-srun", storage, "--launcher", "srun",
        "--image", "pyrecover.sif", "--bind", f"{corpus.parent}:{IN_CONTAINER_DATA}",
        "--set", f"data.path={IN_CONTAINER_DATA}/{corpus.name}")
    check_trained_run(run_dir, job_id, info, log, "slurm")
    script = (run_dir / "job.sbatch").read_text()
    assert "apptainer exec --nv" in script and str(tmp_path / "pyrecover.sif") in script
    assert not Path(IN_CONTAINER_DATA).exists()


def test_torchrun_runs_one_agent_per_node_in_the_container(local_slurm, corpus, tmp_path):
    (tmp_path / "pyrecover.sif").write_text("")
    job_id, run_dir, info, log = run_job(
        local_slurm, tmp_path, "e2e-torchrun", tmp_path / "storage", "--launcher", "torchrun",
        "--image", "pyrecover.sif", "--bind", f"{corpus.parent}:{IN_CONTAINER_DATA}",
        "--set", f"data.path={IN_CONTAINER_DATA}/{corpus.name}")
    check_trained_run(run_dir, job_id, info, log, "torchrun")
    assert "pyrecover.elastic_agent --stop-signal USR2 --nnodes" in (
        run_dir / "job.sbatch").read_text()


def test_launcher_none_runs_this_venvs_python_without_a_container(local_slurm, corpus,
                                                                   tmp_path):
    storage = tmp_path / "storage"
    job_id, run_dir, info, log = run_job(
        local_slurm, tmp_path, "e2e-none", storage, "--set", f"data.path={corpus}")
    check_trained_run(run_dir, job_id, info, log, "slurm")
    script = (run_dir / "job.sbatch").read_text()
    assert "apptainer" not in script and f"{sys.executable} -m pyrecover train" in script
    recorded = (run_dir / "run.yaml").read_text()
    assert f"storage: {storage}" in recorded and f"path: {corpus}" in recorded

    # A relaunch that changes what the run computes is refused before anything is submitted.
    before = script
    done = launch(local_slurm, tmp_path, "--exp-name", "e2e-none",
                  "--set", f"run.storage={storage}", "--set", f"data.path={corpus}",
                  "--set", "model.n_layer=3")
    assert done.returncode == 2 and "was started with another config" in done.stderr
    assert "submitted job" not in done.stdout
    assert (run_dir / "job.sbatch").read_text() == before


def test_a_run_with_a_job_in_the_queue_is_not_launched_again_until_it_is_cancelled(
        local_slurm, corpus, tmp_path):
    """One run, one job: a second launch would rewrite run.yaml under the queued job and then
    wait on the run's lock. `pyrecover cancel` also ends a job that never started."""
    storage = tmp_path / "storage"
    args = ("--exp-name", "queued", "--set", f"run.storage={storage}",
            "--set", f"data.path={corpus}", "--sbatch-extra=--hold")
    job_id = submitted_job(launch(local_slurm, tmp_path, *args))  # held: it never starts
    run_dir = storage / "queued"
    recorded = (run_dir / "run.yaml").read_text()
    said = status(local_slurm, run_dir)
    assert (said["state"], said["job_id"], said["slurm_state"], said["slurm_reason"]) == (
        "not started", str(job_id), "PENDING", "JobHeldUser")  # why it waits, as squeue says
    listed = subprocess.run([sys.executable, "-m", "pyrecover", "status", str(storage)],
                            env=launch_env(local_slurm), capture_output=True, text=True,
                            timeout=60)  # the storage folder: its runs, SLURM asked once
    assert listed.returncode == 0, listed.stderr
    header, row = listed.stdout.splitlines()
    assert header.split()[3:5] == ["JOB", "SLURM"], header
    assert row.split()[:5] == ["queued", f"0/{said['max_steps']}", "none", str(job_id),
                              "PENDING"], row

    again = launch(local_slurm, tmp_path, *args, "--time", "0:07:00")
    assert again.returncode == 2, again.stderr
    assert again.stderr.splitlines()[-1] == (
        f"error: run {run_dir} already has SLURM job {job_id} (PENDING): let it run, or end "
        f"it with `pyrecover cancel {run_dir}` first, or launch under another --exp-name")
    assert "submitted job" not in again.stdout
    assert (run_dir / "run.yaml").read_text() == recorded
    # While SLURM does not answer, a run launched before is not launched again: its job may
    # be in the queue. (A copy of the cluster's config whose controller port nobody serves.)
    unreachable = unreachable_conf(local_slurm, tmp_path)
    again = launch(local_slurm, tmp_path, *args, "--time", "0:07:00", conf=unreachable)
    assert again.returncode == 1, again.stderr  # a fault of the cluster, not a mistake (2)
    assert again.stderr.splitlines()[-1] == (
        f"error: squeue did not answer, so whether run {run_dir} already has a job in the "
        "queue is unknown: try again once SLURM answers (`squeue --me`)")
    assert (run_dir / "run.yaml").read_text() == recorded

    cancel = subprocess.run([sys.executable, "-m", "pyrecover", "cancel", str(run_dir)],
                            env=launch_env(local_slurm), capture_output=True, text=True,
                            timeout=60)
    assert cancel.returncode == 0, cancel.stderr
    assert f"cancelled job {job_id} (PENDING): it was waiting in the queue" in cancel.stderr
    assert local_slurm.wait_job(job_id, timeout=60) == "CANCELLED"
    said = status(local_slurm, run_dir)
    assert (said["state"], said["starts"]) == ("cancelled", 0)  # the job never started it
    # A live run started some other way (srun by hand) holds the run's lock: refused too.
    with RunLock(RunDir(run_dir)):
        again = launch(local_slurm, tmp_path, *args)
    assert again.returncode == 2 and "submitted job" not in again.stdout, again.stderr
    assert again.stderr.splitlines()[-1].startswith(
        f"error: run {run_dir} is in use by a live run (host "), again.stderr
    job_id_2 = submitted_job(launch(local_slurm, tmp_path, *args))  # free again
    said = status(local_slurm, run_dir)  # the queued job, not the cancelled one
    assert (said["job_id"], said["slurm_state"]) == (str(job_id_2), "PENDING"), said
    local_slurm.cancel(job_id_2)


def unreachable_conf(cluster: LocalSlurm, folder: Path) -> Path:
    """unreachable_conf is a copy of the cluster's slurm.conf whose controller port nobody
    serves: every SLURM command fails as it does where the controller is down."""
    conf = folder / "unreachable.conf"
    conf.write_text(re.sub(r"^SlurmctldPort=\d+$", f"SlurmctldPort={free_port()}",
                           cluster.conf_path.read_text(), flags=re.M))
    return conf


def test_a_slurm_that_does_not_answer_ends_launch_and_cancel_with_exit_1_in_one_line(
        local_slurm, corpus, tmp_path):
    """With the controller down, launch and cancel ended with exit 2, the code that says the
    command line or the config must change (and what a job script never requeues): SLURM's
    silence is a fault of the cluster, exit 1, and the command can be typed again as it was."""
    conf = unreachable_conf(local_slurm, tmp_path)
    storage = tmp_path / "storage"
    done = launch(local_slurm, tmp_path, "--exp-name", "down", "--set",
                  f"run.storage={storage}", "--set", f"data.path={corpus}", conf=conf)
    assert done.returncode == 1, done.stderr
    last = done.stderr.splitlines()[-1]
    assert last.startswith("error: sbatch could not reach SLURM, so nothing was submitted: "), last
    assert "Unable to contact slurm controller" in last and "Traceback" not in done.stderr
    assert not storage.exists()  # nothing was submitted: no run folder "not started" is left

    run = RunDir(tmp_path / "run")
    run.create()
    run.event("start", step=0, job_id="4242")  # a run a job started, maybe running now
    env = launch_env(local_slurm) | {"SLURM_CONF": str(conf)}
    done = subprocess.run([sys.executable, "-m", "pyrecover", "cancel", str(run.root)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert done.stderr.splitlines()[-1] == (
        f"error: squeue did not answer, so whether {run.root} has a job queued or running is "
        "unknown: try again once SLURM answers (`squeue --me`)"), done.stderr


def status(cluster: LocalSlurm, run_dir: Path) -> dict:
    done = subprocess.run([sys.executable, "-m", "pyrecover", "status", "--json", str(run_dir)],
                          env=launch_env(cluster), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)
