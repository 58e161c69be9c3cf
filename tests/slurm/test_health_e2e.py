"""Self-healing allocations on a real local SLURM cluster of 3 nodes (CPU, gloo, 1 task per
node, `--launcher none`), against one uninterrupted local run of the same config:

- with `--spare-nodes 1`, node2's task is SIGKILLed mid-run: the job script blames node2
  (srun's report), starts a new step at once on node1 and node3 inside the same allocation,
  resumes from the newest checkpoint, finishes without a requeue, with the same model bit
  for bit; `pyrecover status` names node2;
- the same in memory mode, killed between two snapshots: the new step resumes from the
  survivor's in-memory snapshot (the newest step), not from the disk checkpoint;
- with `--spare-nodes 1`, node2 is set DOWN mid-run (`scontrol update`): the job (--no-kill)
  keeps running without it, and the new step goes to node1 and node3, which SLURM's record
  of the job names, not SLURM_JOB_NODELIST;
- without spares, node2 fails its health check (fault hook): the job requeues with node2 in
  the pending job's excluded nodes (read back from scontrol) and completes elsewhere.

Each test prints its failure-to-first-step time, read from the run's events (README).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import cancelled_after, started_cluster
from localslurm import LocalSlurm
from test_requeue_e2e import (
    INTERVAL,
    MAX_STEPS,
    assert_same_model,
    events,
    explain,
    launch,
    reference_run,
    status,
    wait_end,
    wait_running_at_step,
)

from pyrecover import phases

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    """A 3-node cluster (node1..node3 x 4 CPUs x 4 fake GPUs) for this module."""
    yield from started_cluster(tmp_path_factory.mktemp("slurm3"), nodes=3)


@pytest.fixture
def jobs3(slurm3: LocalSlurm) -> Iterator[list[int]]:
    yield from cancelled_after(slurm3)


@pytest.fixture(scope="module")
def reference_model_2(corpus: Path, tmp_path_factory: pytest.TempPathFactory
                      ) -> dict[str, torch.Tensor]:
    return reference_run(corpus, tmp_path_factory.mktemp("reference2"), 2)


def nodes_of_steps(run_dir: Path, job_id: int) -> list[str]:
    """The nodes each training step ran on, from the job script's own log lines."""
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    return re.findall(r"^pyrecover: job \d+ \(nodes .*\), step \d+ on (\S+), rendezvous",
                      log, re.M)


def test_with_a_spare_node_a_killed_task_restarts_inside_the_allocation_bitwise(
        slurm3, jobs3, corpus, reference_model_2, tmp_path):
    job_id, run_dir = launch(slurm3, jobs3, tmp_path, "spare", corpus, "--spare-nodes", "1",
                             env={"PYRECOVER_KILL_AT_STEP": "7", "PYRECOVER_KILL_RANK": "1",
                                  "PYRECOVER_KILL_TARGET": "self",
                                  "PYRECOVER_KILL_ONCE": str(tmp_path / "killed-once")})
    assert "#SBATCH --nodes=3" in (run_dir / "job.sbatch").read_text()
    info = wait_end(slurm3, job_id, run_dir, timeout=300)

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert info["Restarts"] == "0", explain(run_dir, job_id)  # no requeue, no queue wait
    assert (tmp_path / "killed-once").exists()
    assert nodes_of_steps(run_dir, job_id) == ["node1,node2", "node1,node3"], \
        explain(run_dir, job_id)
    every = events(run_dir)
    assert [(e["event"], e["reason"]) for e in every if e["event"] in (
        "requeue", "no_requeue", "restart_in_job")] == [("restart_in_job", "crash")]
    [resume] = [e for e in every if e["event"] == "resume"]
    assert resume["step"] == INTERVAL and resume["in_job_restart"] == 1
    assert [e["step"] for e in every if e["event"] == "finish"] == [MAX_STEPS]
    report = status(slurm3, run_dir)
    assert [(n["node"], n["reason"]) for n in report["excluded_nodes"]] == [
        ("node2", "task Killed")]
    assert report["state"] == "finished"
    assert_same_model(slurm3, run_dir, reference_model_2)
    print(f"\ncrash to first resumed step, restart inside the allocation: "
          f"{phases.failure_to_first_step(every):.1f}s")


def test_in_memory_mode_the_restart_inside_the_allocation_resumes_from_the_survivors_snapshot(
        slurm3, jobs3, corpus, reference_model_2, tmp_path):
    """No disk checkpoint since step 5: the survivor's in-memory snapshot (its own slice and
    the dead rank's replica) is the newest state, and the new step inside the allocation
    starts from it, bitwise on course."""
    job_id, run_dir = launch(
        slurm3, jobs3, tmp_path, "spare-memory", corpus, "--spare-nodes", "1",
        "--set", "checkpoint.mode=memory", "--set", "checkpoint.snapshot_interval=1",
        env={"PYRECOVER_KILL_AT_STEP": "8", "PYRECOVER_KILL_RANK": "1",
             "PYRECOVER_KILL_POINT": "snapshot", "PYRECOVER_KILL_TARGET": "self",
             "PYRECOVER_KILL_ONCE": str(tmp_path / "killed-once")})
    info = wait_end(slurm3, job_id, run_dir, timeout=300)

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert info["Restarts"] == "0", explain(run_dir, job_id)
    assert nodes_of_steps(run_dir, job_id) == ["node1,node2", "node1,node3"], \
        explain(run_dir, job_id)
    every = events(run_dir)
    # Killed at step 8's snapshot: step 7's was complete on the survivor (faults.py).
    assert [e["step"] for e in every if e["event"] == "snapshot_recovered"] == [7], \
        explain(run_dir, job_id)
    [resume] = [e for e in every if e["event"] == "resume"]
    assert (resume["step"], resume["mode"], resume["in_job_restart"]) == (7, "memory", 1)
    assert [e["step"] for e in every if e["event"] == "finish"] == [MAX_STEPS]
    assert_same_model(slurm3, run_dir, reference_model_2)
    print(f"\ncrash to first resumed step, memory mode inside the allocation: "
          f"{phases.failure_to_first_step(every):.1f}s")


def test_with_a_spare_node_a_node_that_goes_down_is_replaced_without_ending_the_job(
        slurm3, jobs3, corpus, reference_model_2, tmp_path):
    job_id, run_dir = launch(slurm3, jobs3, tmp_path, "node-down", corpus, "--spare-nodes", "1",
                             env={"PYRECOVER_STEP_DELAY": "1"})
    assert "#SBATCH --no-kill" in (run_dir / "job.sbatch").read_text()
    wait_running_at_step(slurm3, job_id, run_dir, 3)
    try:
        slurm3.run("scontrol", "update", "nodename=node2", "state=down", "reason=pyrecover test")
        info = wait_end(slurm3, job_id, run_dir, timeout=300)
    finally:  # the local slurmd answers again at once; make sure node2 takes jobs again
        slurm3.run("scontrol", "update", "nodename=node2", "state=resume", check=False)

    # Without --no-kill SLURM ends (here: requeues) the whole job for the one failed node.
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert info["Restarts"] == "0", explain(run_dir, job_id)
    assert nodes_of_steps(run_dir, job_id) == ["node1,node2", "node1,node3"], \
        explain(run_dir, job_id)
    every = events(run_dir)
    assert [e["event"] for e in every if e["event"] in (
        "requeue", "no_requeue", "restart_in_job")] == ["restart_in_job"]
    assert [e["step"] for e in every if e["event"] == "finish"] == [MAX_STEPS]
    assert_same_model(slurm3, run_dir, reference_model_2)


def test_without_spares_a_node_failing_its_health_check_is_excluded_on_the_requeue(
        slurm3, jobs3, corpus, reference_model_2, tmp_path):
    job_id, run_dir = launch(slurm3, jobs3, tmp_path, "health", corpus,
                             env={"PYRECOVER_HEALTH_FAIL": "node2"})
    info = wait_end(slurm3, job_id, run_dir, timeout=300)

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert info["Restarts"] == "1" and info["ExcNodeList"] == "node2", explain(run_dir, job_id)
    steps = nodes_of_steps(run_dir, job_id)
    assert steps[0] == "node1,node2" and "node2" not in steps[-1], explain(run_dir, job_id)
    every = events(run_dir)
    failed = [e for e in every if e["event"] == "health" and not e["ok"]]
    assert failed and {(e["node"], e["check"]) for e in failed} == {("node2", "storage_write")}
    passed = [e for e in every if e["event"] == "health" and e["ok"]]
    assert len(passed) == 1 and passed[0]["restart_count"] == 1
    [requeue] = [e for e in every if e["event"] == "requeue"]
    assert (requeue["exit_code"], requeue["reason"]) == (77, "health check failed")
    log = (run_dir / "logs" / f"{job_id}.out").read_text()
    assert "pyrecover: health check failed on node node2 (rank 1): storage_write" in log
    assert "pyrecover: the requeued job excludes node2" in log
    report = status(slurm3, run_dir)
    assert [n["node"] for n in report["excluded_nodes"]] == ["node2"]
    assert report["state"] == "finished"
    assert_same_model(slurm3, run_dir, reference_model_2)
    print(f"\nhealth check of a healthy start: {passed[0]['seconds']:.2f}s per task (slowest), "
          f"first collective {passed[0]['collective_seconds']:.2f}s")
    print(f"failed health check to first step, through a requeue: "
          f"{phases.failure_to_first_step(every):.1f}s")


def test_one_node_whose_storage_write_fails_is_replaced_by_its_spare_and_excluded(
        slurm3, jobs3, corpus, tmp_path):
    """`--nodes 1 --spare-nodes 1`: the storage write failed on every node of the step (its
    only one), which blamed no node, so each restart inside the allocation went to node1
    again, the spare never trained and the job failed after its requeues."""
    job_id, run_dir = launch(slurm3, jobs3, tmp_path, "one-node", corpus, "--nodes", "1",
                             "--spare-nodes", "1", env={"PYRECOVER_HEALTH_FAIL": "node1"})
    info = wait_end(slurm3, job_id, run_dir, timeout=300)

    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(run_dir, job_id)
    assert info["Restarts"] == "0", explain(run_dir, job_id)
    assert nodes_of_steps(run_dir, job_id) == ["node1", "node2"], explain(run_dir, job_id)
    every = events(run_dir)
    assert [(e["event"], e["reason"]) for e in every if e["event"] in (
        "requeue", "no_requeue", "restart_in_job")] == [("restart_in_job", "health check failed")]
    assert [e["step"] for e in every if e["event"] == "finish"] == [MAX_STEPS]
    report = status(slurm3, run_dir)
    assert [(n["node"], n["reason"]) for n in report["excluded_nodes"]] == [
        ("node1", "health check failed: storage_write (passed on node2)")]
