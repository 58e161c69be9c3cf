"""The job script's node handling, run by bash with SLURM's commands replaced by stand-ins
(tests/slurm/test_health_e2e.py runs the same on the real local cluster): a node is blamed
only on evidence, excluded from later steps and from the requeued job, and with spare nodes
a failed step restarts inside the allocation. Also `pyrecover status` listing and clearing
the run's bad nodes."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import pyrecover
from sbatch_support import TINY_SETS, spec_for

from pyrecover import status as status_mod
from pyrecover import status_text
from pyrecover.dist import port_for_job
from pyrecover.slurm import render

HEALTH_FAIL = {"event": "health", "time": 5.0, "ok": False, "rank": 1, "node": "node2",
               "check": "gpu", "error": "x", "job_id": "123", "restart_count": 0,
               "in_job_restart": 0, "host": "h"}


def run_job(tmp_path: Path, steps: list[str], spares: int = 0, nodes: str = "node1 node2",
            step_nodes: int = 2,
            partition: str = "node1 node2 node3", bad_nodes: str = "",
            env: dict[str, str] | None = None, extra: tuple[str, ...] = (),
            hostlists: dict[str, str] | None = None
            ) -> tuple[subprocess.CompletedProcess, Path]:
    """Run the rendered script (`step_nodes` training nodes, `spares` more) where the allocation is
    `nodes`, the partition's nodes that can run jobs are `partition` (NAME or NAME:STATE,
    idle by default) and the run's bad-nodes file holds `bad_nodes`; the k-th srun runs
    `steps[k]` (bash, with $EVENTS set) for its effect and exit code. stderr goes to the
    job's log as under SLURM. `env` adds to the job's environment, `extra` is the profile's
    sbatch_extra and `hostlists` what `scontrol show hostnames` makes of other lists than the
    job's (space-separated). Returns (the run, the run dir)."""
    spec = spec_for("none", sets=[*TINY_SETS, f"run.storage={tmp_path / 'store'}"],
                    nodes=step_nodes, spare_nodes=spares, sbatch_extra=extra)
    run = spec.run.root
    (run / "logs").mkdir(parents=True)
    if bad_nodes:
        (run / "bad-nodes").write_text(bad_nodes)
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    for k, body in enumerate(steps):
        (tmp_path / f"step{k}.sh").write_text(body)
    q = shlex.quote
    stubs = {
        "srun": f"n=$(cat {q(str(calls))} 2>/dev/null || echo 0)\n"
                f"echo $((n + 1)) > {q(str(calls))}\n"
                f"printf '%s\\n' \"$*\" >> {q(str(tmp_path / 'srun.argv'))}\n"
                f"source {q(str(tmp_path))}/step$n.sh\n",
        "scontrol": "case $1 in\n" + "".join(
            f" show) [ \"$3\" = {q(k)} ] && {{ printf '%s\\n' {v}; exit; }} ;;&\n"
            for k, v in (hostlists or {}).items())
            + f" show) printf '%s\\n' {nodes} ;;\n"
            f" *) echo \"$*\" >> {q(str(tmp_path / 'scontrol.calls'))} ;;\nesac\n",
        "sinfo": f"for n in {partition}; do state=${{n#*:}}; [ \"$state\" != \"$n\" ] || "
                 "state=idle; echo \"${n%%:*} $state\"; done\n",
        "squeue": "exit 0\n",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(render.render(spec))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "123",
           "SLURM_JOB_NODELIST": "node[1-3]", "SLURM_JOB_PARTITION": "gpu",
           "EVENTS": str(run / "events.jsonl"), **(env or {})}
    with open(run / "logs" / "123.out", "ab") as log:
        done = subprocess.run(["bash", str(script)], env=env, cwd=tmp_path, stdout=log,
                              stderr=log, timeout=60)
    return done, run


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def decisions(run: Path) -> list[tuple[str, int, str]]:
    return [(e["event"], e["exit_code"], e["reason"]) for e in map(json.loads, lines(
        run / "events.jsonl")) if e["event"] in ("requeue", "no_requeue", "restart_in_job")]


def test_with_a_spare_a_killed_task_s_node_is_replaced_and_the_job_finishes_without_requeue(
        tmp_path):
    port = f"echo \"$MASTER_PORT\" >> {shlex.quote(str(tmp_path / 'ports'))}\n"
    killed = port + "echo 'srun: error: node2: task 1: Killed' >&2\nexit 137\n"
    done, run = run_job(tmp_path, [killed, port + "exit 0\n"], spares=1,
                        nodes="node1 node2 node3")
    assert done.returncode == 0, lines(run / "logs" / "123.out")
    argv = lines(tmp_path / "srun.argv")
    assert [a.split()[1:3] for a in argv] == [["--nodelist=node1,node2", "--nodes=2"],
                                              ["--nodelist=node1,node3", "--nodes=2"]]
    steps = spec_for("none").max_restarts_in_job + 1  # each step its port, as dist computes it
    assert lines(tmp_path / "ports") == [str(port_for_job(123, k, steps)) for k in (0, 1)]
    [bad] = [line.split("\t") for line in lines(run / "bad-nodes")]
    assert (bad[0], bad[2]) == ("node2", "task Killed")
    assert decisions(run) == [("restart_in_job", 137, "crash")]
    assert lines(tmp_path / "scontrol.calls") == []  # no requeue, nothing to update


def test_tasks_srun_itself_killed_after_the_failure_are_not_blamed(tmp_path):
    first = ("echo 'srun: error: node2: task 1: Exited with exit code 1' >&2\n"
             "echo 'srun: launch/slurm: _step_signal: Terminating StepId=123.0' >&2\n"
             "echo 'srun: error: node1: task 0: Killed' >&2\nexit 1\n")
    done, run = run_job(tmp_path, [first, "exit 0\n"], spares=1, nodes="node1 node2 node3")
    assert done.returncode == 0
    assert not (run / "bad-nodes").exists()  # an exception is no node's fault
    assert lines(tmp_path / "srun.argv")[1].split()[1] == "--nodelist=node1,node2"


def test_a_node_slurm_found_failed_is_blamed_and_not_the_tasks_killed_after_it(tmp_path):
    # srun's report when a node of a --no-kill job goes down (SLURM 22.05, local cluster).
    lost = ("echo 'srun: error: Node failure on node2' >&2\n"
            "echo 'srun: error: node1: task 0: Killed' >&2\n"
            "echo 'srun: error: node2: task 1: Killed' >&2\n"
            "echo 'srun: Force Terminated StepId=123.0' >&2\nexit 137\n")
    done, run = run_job(tmp_path, [lost, "exit 0\n"], spares=1, nodes="node1 node2 node3")
    assert done.returncode == 0, lines(run / "logs" / "123.out")
    assert [line.split("\t")[::2] for line in lines(run / "bad-nodes")] == [
        ["node2", "node failure"]]
    assert lines(tmp_path / "srun.argv")[1].split()[1] == "--nodelist=node1,node3"


def test_without_spares_a_failed_health_check_excludes_the_node_from_the_requeued_job(
        tmp_path):
    fail = f"echo {shlex.quote(json.dumps(HEALTH_FAIL))} >> \"$EVENTS\"\nexit 143\n"
    done, run = run_job(tmp_path, [fail])
    assert done.returncode == 77  # 143 from SLURM, read back as the trainer's own outcome
    assert decisions(run) == [("requeue", 77, "health check failed")]
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123",
                                                  "update JobId=123 ExcNodeList=node2"]
    assert [line.split("\t")[2] for line in lines(run / "bad-nodes")] == [
        "health check failed: gpu"]
    assert len(lines(tmp_path / "srun.argv")) == 1


def test_a_full_storage_is_no_node_s_fault(tmp_path):
    full = dict(HEALTH_FAIL, check="storage_space")
    done, run = run_job(tmp_path, [f"echo {shlex.quote(json.dumps(full))} >> \"$EVENTS\"\n"
                                   "exit 77\n"])
    assert done.returncode == 77
    assert decisions(run) == [("requeue", 77, "health check failed")]
    assert not (run / "bad-nodes").exists()


def test_a_storage_write_failing_on_every_node_of_the_step_is_the_storage_s_fault(tmp_path):
    both = [dict(HEALTH_FAIL, check="storage_write", node=n, rank=r)
            for r, n in enumerate(("node1", "node2"))]
    step = "".join(f"echo {shlex.quote(json.dumps(e))} >> \"$EVENTS\"\n" for e in both)
    done, run = run_job(tmp_path, [step + "exit 77\n"])
    assert done.returncode == 77
    assert decisions(run) == [("requeue", 77, "health check failed")]
    assert not (run / "bad-nodes").exists()  # excluding both would leave the job no node
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123"]


def test_a_storage_write_failing_on_one_node_of_the_step_blames_that_node(tmp_path):
    one = dict(HEALTH_FAIL, check="storage_write")
    done, run = run_job(tmp_path, [f"echo {shlex.quote(json.dumps(one))} >> \"$EVENTS\"\n"
                                   "exit 77\n"])
    assert done.returncode == 77
    assert [line.split("\t")[::2] for line in lines(run / "bad-nodes")] == [
        ["node2", "health check failed: storage_write"]]


def health_events(*events: dict) -> str:
    return "".join(f"echo {shlex.quote(json.dumps(e))} >> \"$EVENTS\"\n" for e in events)


def storage_failed(node: str, step: int) -> str:
    return health_events(dict(HEALTH_FAIL, check="storage_write", node=node, rank=0,
                              in_job_restart=step)) + "exit 77\n"


def test_one_node_whose_storage_write_fails_is_replaced_by_the_spare_then_excluded(tmp_path):
    """`launch --nodes 1 --spare-nodes 1`: a storage write failing on the only node of the
    step blamed no node (it failed on every node of the step), so every restart inside the
    allocation went to that node again and the spare was never used."""
    passed = {"event": "health", "time": 6.0, "ok": True, "ranks": 1, "job_id": "123",
              "restart_count": 0, "in_job_restart": 1, "host": "h"}
    done, run = run_job(tmp_path, [storage_failed("node1", 0), health_events(passed) + "exit 0"],
                        spares=1, step_nodes=1)
    log = (run / "logs" / "123.out").read_text()
    assert done.returncode == 0, log
    assert [a.split()[1] for a in lines(tmp_path / "srun.argv")] == [
        "--nodelist=node1", "--nodelist=node2"]
    assert decisions(run) == [("restart_in_job", 77, "health check failed")]
    assert "pyrecover: a storage write failed on every node of this step (node1): none is " \
        "excluded, it may be the shared storage; a restart here tries other nodes first" in log
    assert [line.split("\t")[::2] for line in lines(run / "bad-nodes")] == [
        ["node1", "health check failed: storage_write (passed on node2)"]]


def test_a_storage_write_that_works_again_from_a_suspect_excludes_no_node(tmp_path):
    """Two nodes whose storage writes both failed, one spare: the restart takes the spare and
    one of the two. Its health check passing there says the storage took that suspect's
    writes too (the fault passed), so the suspect left out is no more to blame than it."""
    passed = {"event": "health", "time": 6.0, "ok": True, "ranks": 2, "job_id": "123",
              "restart_count": 0, "in_job_restart": 1, "host": "h"}
    both = health_events(*(dict(HEALTH_FAIL, check="storage_write", node=n, rank=r)
                           for r, n in enumerate(("node1", "node2")))) + "exit 77\n"
    done, run = run_job(tmp_path, [both, health_events(passed) + "exit 0"], spares=1,
                        nodes="node1 node2 node3")
    log = (run / "logs" / "123.out").read_text()
    assert done.returncode == 0, log
    assert [a.split()[1] for a in lines(tmp_path / "srun.argv")] == [
        "--nodelist=node1,node2", "--nodelist=node1,node3"]
    assert not (run / "bad-nodes").exists(), lines(run / "bad-nodes")


def test_a_storage_write_failing_on_the_spare_too_is_the_storage_s_and_excludes_none(tmp_path):
    steps = [storage_failed(n, k) for k, n in enumerate(("node1", "node2", "node1"))]
    done, run = run_job(tmp_path, steps, spares=1, step_nodes=1)
    log = (run / "logs" / "123.out").read_text()
    assert done.returncode == 77, log
    assert [a.split()[1] for a in lines(tmp_path / "srun.argv")] == [
        "--nodelist=node1", "--nodelist=node2", "--nodelist=node1"]
    assert "a storage write failed on every node of two steps: the storage's fault" in log
    assert not (run / "bad-nodes").exists()
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123"]


def test_the_script_blames_exactly_the_node_checks_health_py_names():
    from pyrecover import health
    from pyrecover.slurm import blocks

    assert f"check='({'|'.join(health.NODE_CHECKS)})'" in blocks.NODES_BLOCK


def test_a_node_is_not_excluded_where_the_partition_would_be_too_small_for_the_job(tmp_path):
    fail = f"echo {shlex.quote(json.dumps(HEALTH_FAIL))} >> \"$EVENTS\"\nexit 77\n"
    done, run = run_job(tmp_path, [fail], partition="node1 node2")
    assert done.returncode == 77
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123"]
    assert "not excluding node2 from the requeued job: only 1 other usable nodes" in (
        run / "logs" / "123.out").read_text()
    assert lines(run / "bad-nodes")  # still known: later steps avoid it where they can


@pytest.mark.parametrize("partition, excluded", [
    ("node1 node2 node3 node7 node8", "node[7-8],node2"),
    ("node1 node2 node7 node8", "node[7-8]"),  # node2's exclusion would leave one node for 2
])
def test_the_profiles_own_excluded_nodes_stay_excluded_on_every_requeue(tmp_path, partition,
                                                                       excluded):
    # The requeued job's ExcNodeList replaces what sbatch took from the profile's
    # sbatch_extra, so the script adds those nodes itself, and they are no room for the job.
    fail = f"echo {shlex.quote(json.dumps(HEALTH_FAIL))} >> \"$EVENTS\"\nexit 77\n"
    done, run = run_job(tmp_path, [fail], partition=partition, extra=("--exclude=node[7-8]",),
                        hostlists={"node[7-8]": "node7 node8"})
    assert done.returncode == 77
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123",
                                                  f"update JobId=123 ExcNodeList={excluded}"]
    script = (tmp_path / "job.sbatch").read_text()
    assert "#SBATCH --exclude='node[7-8]'" in script and "SITE_EXCLUDE='node[7-8]'" in script


@pytest.mark.parametrize("bad, partition", [
    ("", "node1 node2 node3"),  # node2 cleared since (status --clear-bad-nodes)
    ("node2\t2026-12-01T00:00:00Z\thealth check failed: gpu\n", "node1 node2"),  # no room now
])
def test_a_requeue_lifts_an_exclusion_the_run_no_longer_asks_for(tmp_path, bad, partition):
    """SLURM keeps a job's ExcNodeList across requeues: the script set it only when it had
    nodes to exclude, so node2, excluded once, stayed excluded for good, and a job left
    without room could pend forever."""
    record = {"-o": "'JobId=123 JobState=RUNNING Requeue=1 ExcNodeList=node2 Restarts=1'"}
    done, run = run_job(tmp_path, ["exit 1\n"], bad_nodes=bad, partition=partition,
                        hostlists=record)
    assert done.returncode == 1
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123",
                                                  "update JobId=123 ExcNodeList="]
    assert "the requeued job excludes no node" in (run / "logs" / "123.out").read_text()


def test_drained_and_failing_nodes_do_not_count_as_room_for_the_requeued_job(tmp_path):
    # sinfo's `-t idle` also lists idle nodes that are drained or failing (SLURM 22.05):
    # excluding node2 would leave the job one usable node for its two, pending forever.
    fail = f"echo {shlex.quote(json.dumps(HEALTH_FAIL))} >> \"$EVENTS\"\nexit 77\n"
    done, run = run_job(tmp_path, [fail], partition="node1 node2 node3:drained "
                        "node4:draining node5:fail")
    assert done.returncode == 77
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123"]
    assert "not excluding node2 from the requeued job: only 1 other usable nodes" in (
        run / "logs" / "123.out").read_text()


def test_a_passed_health_check_and_other_steps_records_are_not_taken_as_failures(tmp_path):
    passed = {"event": "health", "time": 5.0, "ok": True, "ranks": 2, "job_id": "123",
              "restart_count": 0, "in_job_restart": 0, "host": "h"}
    other = dict(HEALTH_FAIL, in_job_restart=1)  # a later step's record, not this one's
    step = (f"echo {shlex.quote(json.dumps(other))} >> \"$EVENTS\"\n"
            f"echo {shlex.quote(json.dumps(passed))} >> \"$EVENTS\"\nexit 143\n")
    done, run = run_job(tmp_path, [step])
    assert done.returncode == 143
    assert decisions(run) == [("requeue", 143, "crash")]
    assert not (run / "bad-nodes").exists()


def test_in_job_restarts_stop_at_their_limit_and_the_job_requeues(tmp_path):
    killed = "echo \"srun: error: node$((n + 1)): task 0: Killed\" >&2\nexit 137\n"
    done, run = run_job(tmp_path, [killed] * 3, spares=1, nodes="node1 node2 node3",
                        partition="node1 node2 node3 node4 node5 node6")
    assert done.returncode == 137
    # node1 killed: restart on node2,node3; node2 killed: too few healthy nodes left.
    assert decisions(run) == [("restart_in_job", 137, "crash"), ("requeue", 137, "crash")]
    assert lines(tmp_path / "scontrol.calls") == ["requeue 123",
                                                  "update JobId=123 ExcNodeList=node1,node2"]


def test_status_lists_the_excluded_nodes_and_clears_them(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "events.jsonl").write_text("")
    (run / "run.yaml").write_text("run: {exp_name: run}\n")
    (run / "bad-nodes").write_text("node2\t2026-11-24T05:07:17Z\thealth check failed: gpu\n"
                                   "node5\t2026-11-24T05:09:00Z\ttask Killed\n"
                                   "node2\t2026-11-24T05:10:00Z\thang in phase forward\n")
    report = status_mod.read(run)
    assert report.excluded_nodes == [
        {"node": "node2", "time": "2026-11-24T05:07:17Z", "reason": "health check failed: gpu"},
        {"node": "node5", "time": "2026-11-24T05:09:00Z", "reason": "task Killed"}]
    assert "excluded    node2 since 2026-11-24T05:07:17Z: health check failed: gpu" in \
        status_text.render(report)
    done = pyrecover("status", str(run), "--clear-bad-nodes", "--json")
    assert done.returncode == 0, done.stderr
    assert "cleared 2 excluded node(s): node2, node5" in done.stderr
    assert json.loads(done.stdout)["excluded_nodes"] == []
    assert not (run / "bad-nodes").exists()


def test_clearing_refuses_what_is_not_a_run_directory(tmp_path):
    done = pyrecover("status", str(tmp_path / "nowhere"), "--clear-bad-nodes")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr


def test_a_rank_that_hangs_outside_a_collective_blames_its_node_and_its_waiting_peers_do_not(
        tmp_path):
    def hang(rank, node, phase):
        return {"event": "hang", "time": 9.0, "rank": rank, "node": node, "phase": phase,
                "step": 9, "job_id": "123", "restart_count": 0, "in_job_restart": 0}

    # On CUDA a rank whose peer is stuck waits for its GPU (phase `device`), and under FSDP
    # in its forward's all-gathers or its optimizer's norm all-reduce: no blame.
    step = "".join(f"echo {shlex.quote(json.dumps(h))} >> \"$EVENTS\"\n" for h in (
        hang(0, "node1", "backward"), hang(1, "node2", "forward"),
        hang(2, "node3", "device"), hang(3, "node1", "fsdp_forward"),
        hang(4, "node3", "fsdp_optimizer"))) + "exit 76\n"
    done, run = run_job(tmp_path, [step, "exit 0\n"], spares=1, nodes="node1 node2 node3")
    assert done.returncode == 0
    assert [line.split("\t")[::2] for line in lines(run / "bad-nodes")] == [
        ["node2", "hang in phase forward"]]
    assert decisions(run) == [("restart_in_job", 76, "hang")]


def test_a_rank_that_stopped_is_blamed_through_the_heartbeat_its_reporting_peers_read(tmp_path):
    """A SIGSTOPped rank reports nothing; its peers, waiting in a collective, name the node
    whose heartbeat stopped (hang_report.handle's `suspect_node`); the stack text they dump
    cannot pass for that field."""
    def hang(rank, node, **named):
        return {"event": "hang", "time": 9.0, "rank": rank, "node": node,
                "phase": "allreduce", "step": 9, "seconds": 6.0, "limit": 5.0, "cuda": "n/a",
                **named, "stacks": 'x = {"suspect_node": "node9", "stacks": ""}',
                "job_id": "123", "restart_count": 0, "in_job_restart": 0}

    reports = (hang(0, "node1", silent_ranks=[1], silent_nodes=["node2"], suspect_node="node2"),
               hang(2, "node3"))  # a later reporter that saw no silent peer names no one
    step = "".join(f"echo {shlex.quote(json.dumps(h))} >> \"$EVENTS\"\n"
                   for h in reports) + "exit 76\n"
    done, run = run_job(tmp_path, [step, "exit 0\n"], spares=1, nodes="node1 node2 node3")
    assert done.returncode == 0
    assert [line.split("\t")[::2] for line in lines(run / "bad-nodes")] == [
        ["node2", "silent in a hang"]]
    assert decisions(run) == [("restart_in_job", 76, "hang")]


def test_a_step_that_must_keep_a_bad_node_lists_its_nodes_in_the_allocations_order(tmp_path):
    """srun places rank 0 on the step's first node in the allocation's order, whatever order
    --nodelist gives; the rendezvous (MASTER_ADDR) must be that node, or the other ranks wait
    for a store nobody hosts. Here node1 is bad but the partition has no other node to
    spare, so the requeued job got node1 again and must use it."""
    step = f"echo \"$MASTER_ADDR\" > {shlex.quote(str(tmp_path / 'master'))}\nexit 0\n"
    done, run = run_job(tmp_path, [step], nodes="node1 node2",
                        bad_nodes="node1\t2026-11-25T08:00:00Z\tsilent in a hang\n")
    assert done.returncode == 0
    assert lines(tmp_path / "srun.argv")[0].split()[1] == "--nodelist=node1,node2"
    assert lines(tmp_path / "master") == ["node1"]
