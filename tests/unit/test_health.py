"""The health check's parts (pyrecover/health.py), each against the real thing it checks."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from pyrecover import faults, health


def test_a_failure_is_one_line_naming_the_node_and_the_check():
    line = health.Failure("storage_write", "node7", 3, "took 12.0s (bound 10s)").line()
    assert "\n" not in line
    assert line == ("pyrecover: health check failed on node node7 (rank 3): storage_write: "
                    "took 12.0s (bound 10s)")


def test_the_first_failing_check_is_reported_and_the_later_ones_do_not_run():
    ran = []

    def check(name, result):
        return lambda: ran.append(name) or result

    checks = {"gpu": check("gpu", None), "memory": check("memory", "too little"),
              "storage_space": check("storage_space", "never reached")}
    failure = health.local_checks(checks, "node2", 1)
    assert failure == health.Failure("memory", "node2", 1, "too little")
    assert ran == ["gpu", "memory"]
    assert health.local_checks({"gpu": check("gpu", None)}, "node2", 1) is None


def test_an_injected_fault_fails_its_check_only_on_the_named_nodes(monkeypatch):
    monkeypatch.setenv("PYRECOVER_HEALTH_FAIL", "node2,node3")
    assert faults.health_fault("node1") is None
    assert faults.health_fault("node3") == "storage_write"
    monkeypatch.setenv("PYRECOVER_HEALTH_FAIL_CHECK", "gpu")
    assert faults.health_fault("node2") == "gpu"
    failure = health.local_checks({"gpu": lambda: None}, "node2", 0, faults.health_fault("node2"))
    assert failure is not None and failure.check == "gpu" and "injected" in failure.detail


def test_the_gpu_check_is_skipped_on_the_cpu_path():
    assert health.check_gpu("cpu", 0, 4) is None


@pytest.mark.parametrize("seen,tasks,short", [(8, 8, False), (7, 8, True), (0, 1, True),
                                              (1, 8, False), (1, 1, False), (2, 4, True)])
def test_a_node_is_short_of_gpus_unless_each_task_sees_one_or_all_are_there(seen, tasks, short):
    """A GPU fallen off the bus (7 of 8) makes a bad node; a task shown only its own GPU by
    SLURM's per-task binding (1 of 8) does not, or every node of such a cluster would be
    excluded."""
    said = health.too_few_gpus(seen, tasks)
    assert (said == f"{seen} GPU(s) visible, this node's {tasks} tasks need one each"
            if short else said is None)


def test_memory_is_compared_with_what_the_state_needs():
    assert health.check_memory(2**30, available=2**31) is None
    said = health.check_memory(2**31, available=2**30)
    assert said == "1.00 GiB host memory available, the configured state needs 2.00 GiB"
    assert health.mem_available() is None or health.mem_available() > 0


def test_sizes_under_a_gib_are_said_in_mib():
    """A small disk said "0.00 GiB free ..., a checkpoint needs 0.00 GiB"."""
    assert health._gib(3 * 2**20) == "3.0 MiB" and health._gib(3 * 2**30) == "3.00 GiB"
    said = health.check_memory(300 * 2**20, available=200 * 2**20)
    assert said == "200.0 MiB host memory available, the configured state needs 300.0 MiB"


def test_memory_mode_needs_room_for_its_snapshots_and_replicas():
    plain = health.state_bytes(1000, "dcp", 2, 4)
    assert plain == 4 * 1000 * health.BYTES_PER_PARAM
    snapshots = health.snapshot_bytes(1000, 2, 4, 4)
    assert health.state_bytes(1000, "memory", 2, 4) == plain + snapshots
    # On a GPU the state is in device memory, memory mode's snapshots still in the host's.
    assert health.state_bytes(1000, "memory", 2, 4, on_cpu=False) == snapshots
    assert health.state_bytes(1000, "dcp", 2, 4, on_cpu=False) == 0


@pytest.mark.parametrize("world_size,per_node,replicas", [
    (1, 1, 2), (2, 2, 2), (8, 8, 2), (8, 8, 3), (16, 8, 2), (128, 8, 2), (6, 3, 1), (4, 2, 5)])
def test_the_snapshots_counted_are_the_slices_each_rank_of_a_node_holds(world_size, per_node,
                                                                       replicas):
    """The check sized memory mode's snapshots as 1 + replicas whole states per node: on one
    node of 8 GPUs half of what the three snapshot sets hold (so the first snapshots could run
    out of memory), on 16 nodes 8 times it (so every healthy node failed the check)."""
    from pyrecover.checkpoint.memory import layout

    params = 1_000_003
    state = params * health.CHECKPOINT_BYTES_PER_PARAM
    bounds = layout.slice_bounds(state, world_size)
    held = [0] * world_size  # bytes of the slices each rank holds in one snapshot set
    for s, (a, b) in enumerate(bounds):
        for rank in layout.holders(s, world_size, replicas, per_node):
            held[rank] += b - a
    node = max(3 * sum(held[n:n + per_node]) for n in range(0, world_size, per_node))
    counted = health.state_bytes(params, "memory", replicas, per_node, False, world_size)
    assert node <= counted <= node + 3 * per_node * min(replicas, world_size)  # (rounding)


@pytest.mark.skipif(health.mem_available() is None, reason="no MemAvailable to compare with")
def test_a_gpu_node_without_host_memory_for_memory_mode_s_snapshots_fails_its_check(tmp_path):
    """checks_for counted no host memory at all on CUDA, memory mode's snapshots included: a
    node without room passed, then failed at its first snapshot."""
    from pyrecover import config
    from pyrecover.dist import DistEnv
    from pyrecover.rundir import RunDir

    env = DistEnv("single", 0, 1, 0, 1, 0, "127.0.0.1", 29500)
    big = ["model.n_layer=48", "model.n_embd=8192", "model.n_head=64"]  # 39B parameters
    for mode, fails in (("memory", True), ("dcp", False)):
        cfg = config.load(None, [*big, f"checkpoint.mode={mode}"])
        said = health.checks_for(cfg, env, RunDir(tmp_path / mode), "cuda")["memory"]()
        assert (said is not None and "host memory available" in said) == fails, (mode, said)


def test_storage_space_is_the_filesystem_s_free_space(tmp_path: Path):
    assert health.check_storage_space(tmp_path, 1) is None
    said = health.check_storage_space(tmp_path, 2**62)
    assert said is not None and "free under" in said and str(tmp_path) in said


def test_storage_that_is_not_a_folder_fails_its_check_with_a_line_not_a_traceback(
        tmp_path: Path):
    storage = tmp_path / "storage"
    storage.write_text("a file where the storage folder should be")
    checks = {"storage_space": lambda: health.check_storage_space(storage / "run", 1)}
    failure = health.local_checks(checks, "node2", 0)
    assert failure is not None and failure.check == "storage_space"
    assert "Not a directory" in failure.detail and str(storage / "run") in failure.detail


def test_the_storage_write_leaves_nothing_behind_and_reports_a_folder_it_cannot_write(
        tmp_path: Path):
    assert health.check_storage_write(tmp_path, "rank0") is None
    assert list(tmp_path.iterdir()) == []
    said = health.check_storage_write(tmp_path / "gone", "rank0")
    assert said is not None and said.startswith("cannot write and fsync a file in")


def test_a_storage_that_refuses_the_write_fails_the_write_check(tmp_path: Path):
    """A storage that takes no byte (a full quota), made with RLIMIT_FSIZE so that it holds
    for root too (CI runs as root, and root writes into read-only folders)."""
    code = ("import pathlib, sys; from pyrecover import health; "
            "print(health.check_storage_write(pathlib.Path(sys.argv[1]), 'rank0'))")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                          text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("cannot write and fsync a file in"), done.stdout
    assert list(tmp_path.iterdir()) == []  # nothing left behind


def test_a_checkpoints_folder_that_refuses_writes_fails_under_a_writable_run_folder(
        tmp_path: Path):
    """checkpoints/ linked to a folder nothing can be created in (/proc/1, as for root too):
    the run folder takes the write, the saves' folder is named as the one that refused."""
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    assert health.check_storage_writes(run, "rank0") is None
    run.checkpoints.rmdir()
    run.checkpoints.symlink_to("/proc/1")
    said = health.check_storage_writes(run, "rank0")
    assert said is not None
    assert said.startswith(f"cannot write and fsync a file in {run.checkpoints}:"), said
    assert sorted(p.name for p in run.root.iterdir()) == ["checkpoints", "logs"]


def test_a_write_slower_than_its_bound_fails(tmp_path: Path):
    said = health.check_storage_write(tmp_path, "rank0", bound_s=-1.0)
    assert said is not None and "bound" in said


def test_without_a_process_group_the_collective_returns_the_value():
    assert health.first_collective(1.0, 0.25) == 0.25


def test_the_parameter_estimate_is_close_to_the_model_s_own_count():
    from pyrecover.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=320, block_size=64, n_layer=2, n_head=2, n_embd=64)
    real = GPT(cfg).num_params()
    guess = health.approx_params(2, 64, 320, 64)
    assert abs(guess - real) / real < 0.1
