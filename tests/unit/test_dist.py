"""Where a process sits in the job, read from its environment alone."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyrecover.dist import (
    PORT_BASE,
    PORT_SPAN,
    DistError,
    cpu_threads,
    detect,
    device_index,
    port_for_job,
    shared_gpus,
)
from pyrecover.hostlist import expand_hostlist, expand_tasks_per_node
from pyrecover.spawn import exit_status, worker_envs


@pytest.mark.parametrize("nodelist, hosts", [
    ("node1", ["node1"]),
    ("node[1-2]", ["node1", "node2"]),
    ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
    ("gpu[001-004,010]", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu010"]),
    ("a1,b[2-3]", ["a1", "b2", "b3"]),
    ("node[1-2],gpu[01-03,7]", ["node1", "node2", "gpu01", "gpu02", "gpu03", "gpu7"]),
    ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
    ("nid[098-101]", ["nid098", "nid099", "nid100", "nid101"]),
])
def test_slurm_nodelists_expand_like_scontrol_show_hostnames(nodelist, hosts):
    assert expand_hostlist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["", "node[1-", "node1-2]", "node[a-b]"])
def test_a_malformed_nodelist_is_an_error_naming_it(bad):
    with pytest.raises(DistError):
        expand_hostlist(bad)


def test_tasks_per_node_expands_slurms_repeat_notation():
    assert expand_tasks_per_node("4(x2),3") == [4, 4, 3]
    assert expand_tasks_per_node("2") == [2]


SRUN_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[007-008]",
    "SLURM_TASKS_PER_NODE": "4(x2)",
}


@pytest.mark.parametrize("environ, expected", [
    ({}, ("single", 0, 1, 0, 1, 0, "127.0.0.1")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4",
      "GROUP_RANK": "0", "MASTER_ADDR": "gpu007", "MASTER_PORT": "29400"},
     ("torchrun", 3, 8, 3, 4, 0, "gpu007")),
    (SRUN_TASK, ("slurm", 5, 8, 1, 4, 1, "gpu007")),
    ({**SRUN_TASK, "MASTER_ADDR": "10.0.0.7"}, ("slurm", 5, 8, 1, 4, 1, "10.0.0.7")),
    # torchrun started by srun sees both; torchrun's variables describe this process.
    ({**SRUN_TASK, "RANK": "2", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "4",
      "GROUP_RANK": "0", "MASTER_ADDR": "gpu007"}, ("torchrun", 2, 8, 2, 4, 0, "gpu007")),
    # The batch shell has SLURM_PROCID but no step: not a task of a distributed step.
    ({k: v for k, v in SRUN_TASK.items() if k != "SLURM_STEP_ID"},
     ("single", 0, 1, 0, 1, 0, "127.0.0.1")),
])
def test_detect_reads_the_layout_from_each_launchers_variables(environ, expected):
    env = detect(environ)
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_world_size,
            env.node_rank, env.master_addr) == expected


TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu007",
            "MASTER_PORT": "29400", "TORCHELASTIC_RESTART_COUNT": "2",
            "TORCHELASTIC_MAX_RESTARTS": "3"}


@pytest.mark.parametrize("environ, attempt, prefix, rendezvous", [
    # The agent's store outlives the workers: this restart's keys lie under its count.
    ({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "True"}, 2, 2, "store"),
    # A store per round (pyrecover.elastic_agent): the counts of two nodes may differ.
    ({**TORCHRUN, "TORCHELASTIC_USE_AGENT_STORE": "False"}, 2, 0, "init_method"),
    ({k: v for k, v in TORCHRUN.items() if not k.startswith("TORCHELASTIC")}, 0, 0,
     "init_method"),
])
def test_under_torchrun_only_the_agents_own_store_keys_the_restart(environ, attempt, prefix,
                                                                     rendezvous):
    from datetime import timedelta

    from pyrecover import dist

    env = detect(environ)
    assert (env.attempt, env.store_attempt) == (attempt, prefix)
    if rendezvous == "init_method":  # no store is reached for: rank 0 serves it at start
        assert dist.rendezvous(env, timedelta(seconds=1)) == {
            "init_method": "tcp://gpu007:29400"}
    else:
        assert env.agent_store and env.max_restarts == 3


@pytest.mark.parametrize("local_world, warned", [(1, True), (2, False)])
def test_a_plain_torchrun_over_several_nodes_with_restarts_is_told_what_to_do(
        local_world, warned, caplog):
    """Over several nodes the restart counts can part (test_torchrun_nodes); on one they
    cannot, and nothing is said."""
    import logging
    from datetime import timedelta

    from torch.distributed import TCPStore

    from pyrecover import dist, spawn

    port = spawn.free_port()
    agent = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = detect({**TORCHRUN, "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                  "MASTER_PORT": str(port), "LOCAL_WORLD_SIZE": str(local_world),
                  "TORCHELASTIC_USE_AGENT_STORE": "True"})
    with caplog.at_level(logging.WARNING, logger="pyrecover"):
        store = dist.rendezvous(env, timedelta(seconds=10))["store"]
    store.set("k", "v")  # this attempt's keys, under its own prefix in the agent's store
    assert agent.get("pyrecover/attempt_2/pg/k") == b"v"
    said = [r.getMessage() for r in caplog.records]
    assert bool([m for m in said if "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in m]) == warned


def test_under_srun_the_port_comes_from_the_job_id_unless_master_port_is_set():
    assert detect(SRUN_TASK).master_port == port_for_job(4242)
    assert detect({**SRUN_TASK, "MASTER_PORT": "23456"}).master_port == 23456


@pytest.mark.parametrize("job", [0, 1, 4242, 19999, 20000, 10**7 + 3])
def test_job_ports_are_unprivileged_and_below_the_ephemeral_range(job):
    assert 1024 < port_for_job(job) < 32768


def test_two_consecutive_jobs_get_different_ports():
    assert port_for_job(100) != port_for_job(101)


@pytest.mark.parametrize("environ", [
    {"RANK": "2", "WORLD_SIZE": "2"},
    {"RANK": "x", "WORLD_SIZE": "2"},
    {**SRUN_TASK, "SLURM_PROCID": "8"},
])
def test_an_impossible_layout_is_an_error(environ):
    with pytest.raises(DistError):
        detect(environ)


@pytest.mark.parametrize("local_rank, visible, index", [
    (0, 1, 0), (3, 1, 0),       # SLURM gave each task its own GPU (--gpus-per-task=1)
    (0, 4, 0), (3, 4, 3),       # every task sees all GPUs of the node
])
def test_each_local_rank_gets_its_own_gpu_either_way_slurm_exposes_them(local_rank, visible,
                                                                         index):
    assert device_index(local_rank, visible) == index


def test_more_local_ranks_than_visible_gpus_is_an_error():
    with pytest.raises(DistError, match="local rank 2"):
        device_index(2, 2)


# One srun task per node (`--launcher spawn`) on node 2 of 2, each task 2 GPUs: the task
# runs `pyrecover train --nproc 2`, whose workers see the task's variables plus their own.
SPAWN_TASK = {
    "SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
    "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "node[1-2]",
    "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "2(x2)",
    "MASTER_ADDR": "node1", "MASTER_PORT": "14242",
}


def test_spawned_workers_under_one_task_per_node_are_ranks_of_one_group():
    task = detect(SPAWN_TASK)
    assert (task.launcher, task.rank, task.world_size, task.local_world_size) == (
        "slurm", 1, 2, 1)
    workers = [detect({**SPAWN_TASK, **env}) for env in worker_envs(task, 2)]
    assert [(w.launcher, w.rank, w.world_size, w.local_rank, w.local_world_size, w.node_rank,
             w.master_addr, w.master_port) for w in workers] == [
        ("spawn", 2, 4, 0, 2, 1, "node1", 14242),
        ("spawn", 3, 4, 1, 2, 1, "node1", 14242),
    ]


def test_spawned_workers_alone_on_one_machine_are_ranks_0_to_n():
    alone = detect({})
    workers = [detect(env) for env in worker_envs(alone, 3)]
    assert [(w.launcher, w.rank, w.world_size, w.local_rank) for w in workers] == [
        ("spawn", 0, 3, 0), ("spawn", 1, 3, 1), ("spawn", 2, 3, 2)]


def test_spawning_under_several_tasks_per_node_is_refused_with_what_to_do():
    with pytest.raises(DistError, match="one task per node"):
        worker_envs(detect(SRUN_TASK), 4)
    with pytest.raises(DistError, match="already a worker"):
        worker_envs(detect({"RANK": "0", "WORLD_SIZE": "2"}), 2)


@pytest.mark.parametrize("code, status", [(0, 0), (75, 75), (1, 1), (-9, 137), (-15, 143)])
def test_a_workers_death_by_signal_reads_as_the_shell_shows_it(code, status):
    assert exit_status(code) == status


@pytest.mark.parametrize("environ,cores,local,expected", [
    ({}, 16, 4, 4), ({}, 2, 4, 1), ({}, 2, 1, 2),
    ({"OMP_NUM_THREADS": "3"}, 16, 4, 3),  # set by the user or torchrun: it wins
    ({"OMP_NUM_THREADS": "0"}, 16, 4, 4), ({"OMP_NUM_THREADS": "many"}, 16, 4, 4)])
def test_cpu_ranks_share_the_nodes_cores_unless_omp_num_threads_pins_them(environ, cores, local,
                                                                          expected):
    assert cpu_threads(environ, cores, local) == expected


def test_visible_gpus_without_a_gpu_device_answers_without_importing_torch(tmp_path):
    # A launcher (`train --nproc`) asks before it starts its workers: where the kernel has no
    # GPU device, torch could see none, and importing it would cost every start a second.
    probe = ("import sys; from pyrecover import dist; "
             f"print(dist.visible_gpus({str(tmp_path)!r}), 'torch' in sys.modules)")
    (tmp_path / "null").touch()
    (tmp_path / "nvidia-uvm").touch()  # the driver's helpers are no GPU
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.stdout.split() == ["0", "False"], run.stderr
    (tmp_path / "nvidia0").touch()  # a GPU node: torch is asked, and counts what it sees
    import torch

    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert run.stdout.split() == [str(seen), "True"], run.stderr


@pytest.mark.parametrize("failures, code", [
    ([], 0),
    ([1], 1),                 # only peers that lost one: a crash
    ([1, 76], 76),            # the peer left first, the hung rank's own code is the cause
    ([76, 1], 76),
    ([1, -9], -9),            # a killed worker seen after its survivor: the kill
    ([2, 1], 2),              # a config error on one rank
    ([77, 76], 77),           # the first cause wins
    ([75, 1], 75),            # neither names a cause: the first, as ever
    ([1, 75], 1),
])
def test_the_launcher_reports_the_cause_not_the_peer_that_noticed_it(failures, code):
    from pyrecover.spawn import cause

    assert cause(failures) == code


def test_a_free_port_is_outside_the_ephemeral_range_and_can_be_listened_on(monkeypatch):
    # Outgoing connections take their local ports from the ephemeral range: one picked there
    # could be handed to another socket before the rendezvous binds it.
    import socket

    from pyrecover import spawn

    low, high = map(int, spawn._PORT_RANGE.read_text().split())
    ports = {spawn.free_port() for _ in range(20)}
    assert all(spawn._PORTS_FROM <= p < low for p in ports), (ports, low, high)
    with socket.create_server(("127.0.0.1", ports.pop())):
        pass
    monkeypatch.setattr(spawn, "_PORT_RANGE", spawn.Path("/nonexistent"))
    assert 0 < spawn.free_port() < 65536  # no /proc: the kernel's choice


@pytest.mark.parametrize("steps", [1, 3, 8])
def test_jobs_with_neighbouring_ids_never_share_a_rendezvous_port_in_any_of_their_steps(steps):
    """A sweep's trials are jobs with neighbouring ids, often on one node; a restart inside
    the allocation starts a new step on a new port. With the job id plus the step, job N's
    second step took job N+1's first port (seen as EADDRINUSE under load)."""
    jobs = range(4_000_000, 4_000_000 + 20_000 // steps)
    ports = [port_for_job(job, step, steps) for job in jobs for step in range(steps)]
    assert len(set(ports)) == len(ports)
    assert all(PORT_BASE <= p < PORT_BASE + PORT_SPAN for p in ports)


def test_ranks_sharing_one_gpu_on_a_node_are_named_and_the_same_uuid_on_two_nodes_is_not():
    own = [("node1", "GPU-a"), ("node1", "GPU-b"), ("node2", "GPU-a"), ("node2", "GPU-b")]
    assert shared_gpus(own) is None  # (a UUID is the device's; another node's is another GPU)
    said = shared_gpus([("node1", "GPU-a"), ("node1", "GPU-b"), ("node1", "GPU-a")])
    assert said is not None and said.startswith("ranks 0 and 2 on node1 see the same single GPU")
    assert "train.device=cpu" in said and "\n" not in said
