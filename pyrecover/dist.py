"""Where this process sits in the job: detection, process groups, devices, local workers.

`detect(environ)` is pure: it reads a mapping and says which launcher started us (torchrun or
pyrecover's own `--nproc`, an `srun` task, or nothing) and what rank we are. Setting up the
process group, binding a device and spawning local workers are separate functions, so tests
can check detection over a table of environments without starting anything.
This module imports nothing else from the project but the pure `hostlist` (torch is imported
only where needed).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import re
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from pyrecover.hostlist import DistError, expand_hostlist, expand_tasks_per_node
from pyrecover.oneline import first_line


@dataclass(frozen=True)
class DistEnv:
    launcher: str  # "torchrun", "slurm" or "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    # torchrun's: which restart of the workers this is (this node's agent's count), how many
    # it allows, and whether MASTER_PORT is its agent's store, which outlives each attempt's
    # workers and so holds the last one's keys
    attempt: int = 0
    agent_store: bool = False
    max_restarts: int = 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def store_attempt(self) -> int:
        """store_attempt names this attempt's keys in the rendezvous store: the restart count
        where that store is torchrun's agent's, kept across restarts; 0 where every start
        has a store of its own (pyrecover's launchers, `pyrecover.elastic_agent`), since
        there a node's count need not be another's (a restart for a membership change
        counts on no node, one for a failure only on the failed one's)."""
        return self.attempt if self.agent_store else 0


SPAWNED = "PYRECOVER_SPAWNED"  # set for workers of `pyrecover train --nproc N` (spawn.py)
PORT_BASE, PORT_SPAN = 10000, 20000  # unprivileged and below Linux's ephemeral range


def detect(environ: Mapping[str, str]) -> DistEnv:
    """detect returns the layout from torchrun-style, SLURM-task or no variables, in that order.

    torchrun-style variables win because `torchrun` inside an `srun` step sees both.
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _from_torchrun(environ)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ and "SLURM_NTASKS" in environ:
        return _from_slurm(environ)
    return DistEnv("single", 0, 1, 0, 1, 0, "127.0.0.1", _int(environ, "MASTER_PORT", 29500))


def _from_torchrun(env: Mapping[str, str]) -> DistEnv:
    world = _int(env, "WORLD_SIZE")
    local_world = _int(env, "LOCAL_WORLD_SIZE", world)
    return _checked(DistEnv(
        launcher="spawn" if env.get(SPAWNED) == "1" else "torchrun",
        rank=_int(env, "RANK"),
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", 0),
        local_world_size=local_world,
        node_rank=_int(env, "GROUP_RANK", _int(env, "NODE_RANK", 0)),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", 29500),
        attempt=_int(env, "TORCHELASTIC_RESTART_COUNT", 0),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        max_restarts=_int(env, "TORCHELASTIC_MAX_RESTARTS", 0),
    ))


def _from_slurm(env: Mapping[str, str]) -> DistEnv:
    node_rank = _int(env, "SLURM_NODEID", 0)
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or ""
    counts = expand_tasks_per_node(per_node) if per_node else [_int(env, "SLURM_NTASKS")]
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    master = env.get("MASTER_ADDR") or (expand_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
    if "MASTER_PORT" in env:
        port = _int(env, "MASTER_PORT")
    else:
        port = port_for_job(_int(env, "SLURM_JOB_ID", 0))
    return _checked(DistEnv(
        launcher="slurm",
        rank=_int(env, "SLURM_PROCID"),
        world_size=_int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS")),
        local_rank=_int(env, "SLURM_LOCALID", 0),
        local_world_size=counts[node_rank] if node_rank < len(counts) else counts[-1],
        node_rank=node_rank,
        master_addr=master,
        master_port=port,
    ))


def port_for_job(job_id: int, step: int = 0, steps: int = 1) -> int:
    """port_for_job is the rendezvous port of step `step` (0, 1, ...: a restart inside the
    allocation starts a new one) of a SLURM job that may run `steps` of them. Each job has a
    block of `steps` ports of its own, so neither a new step and its job's last one, whose
    processes may still be leaving, nor two jobs with neighbouring ids on one node (a sweep's
    trials) share a port; two concurrent jobs whose ids differ by about PORT_SPAN / steps can.
    The job script computes the same in shell (slurm/render.py)."""
    return PORT_BASE + (job_id * steps + step) % PORT_SPAN


def visible_gpus(dev: str = "/dev") -> int:
    """visible_gpus is how many CUDA devices this process sees (0 without CUDA).

    Where the kernel has no GPU device (no NVIDIA /dev/nvidiaN, no ROCm /dev/kfd) torch can
    see none either, and the answer comes without importing torch (about a second of CPU,
    which a launcher such as `train --nproc` would pay on every start before its workers).
    """
    if os.path.isdir(dev) and not any(re.fullmatch(r"nvidia\d+|kfd", n) for n in os.listdir(dev)):
        return 0
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def device_index(local_rank: int, visible_gpus: int) -> int:
    """device_index picks this rank's GPU among the visible ones.

    SLURM either shows every GPU of the node to every task (pick by local rank) or one GPU per
    task through CUDA_VISIBLE_DEVICES (then that one is device 0).
    """
    if visible_gpus < 1:
        raise DistError("no visible GPU")
    if visible_gpus == 1:
        return 0
    if local_rank >= visible_gpus:
        raise DistError(f"local rank {local_rank} but only {visible_gpus} GPUs are visible")
    return local_rank


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    value = env.get(key)
    if value is None or value == "":
        if default is None:
            raise DistError(f"environment variable {key} is not set")
        return default
    try:
        return int(value)
    except ValueError:
        raise DistError(f"environment variable {key}={value!r} is not an integer") from None


def _checked(env: DistEnv) -> DistEnv:
    if not 0 <= env.rank < env.world_size:
        raise DistError(f"rank {env.rank} is outside world size {env.world_size}")
    if not 0 <= env.local_rank < max(env.local_world_size, 1):
        raise DistError(
            f"local rank {env.local_rank} is outside {env.local_world_size} local tasks")
    return env


# --- process group ------------------------------------------------------------------------


class GroupUnreachable(RuntimeError):
    """The process group did not form: a peer never came, or rank 0's address is out of
    reach (a fault, exit 1: the job script restarts it)."""


def setup(env: DistEnv, device_kind: str, timeout_s: float = 600.0):
    """setup binds this rank's device and joins the process group; returns the torch device.

    Pair every call with `teardown()` in a `finally`.
    """
    import torch
    import torch.distributed as tdist

    # One GPU visible to each of a node's several tasks: SLURM gave each its own
    # (--gpus-per-task, --gpu-bind) or they all see the same one, which NCCL's eager start
    # would refuse with a traceback of its own. Then the group starts lazily and the ranks
    # compare their GPUs first (check_own_gpus).
    one_each = False
    if device_kind == "cuda":
        visible = torch.cuda.device_count()
        device = torch.device("cuda", device_index(env.local_rank, visible))
        torch.cuda.set_device(device)
        one_each = visible == 1 and env.local_world_size > 1
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(os.environ, len(os.sched_getaffinity(0)),
                                          env.local_world_size))
    global _set_up
    _set_up = True
    if env.is_distributed:
        # Before the group: its functions' `group=group.WORLD` defaults, bound at import
        # (torch._dynamo imports it, for DDP), held the group for good, so that leaving it
        # (teardown) closed no connection: a peer blocked on rank 0 waited for its exit.
        importlib.import_module("torch.distributed.nn")
        try:
            tdist.init_process_group(
                # CPU tensors (stop flags, checkpoint agreement, object gathers) go over gloo
                # even on GPUs, so they never queue behind NCCL kernels.
                backend="cpu:gloo,cuda:nccl" if device_kind == "cuda" else "gloo",
                **rendezvous(env, timedelta(seconds=timeout_s)),
                rank=env.rank,
                world_size=env.world_size,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if device_kind == "cuda" and not one_each else None,
            )
        except (tdist.DistNetworkError, tdist.DistStoreError) as exc:  # not a traceback
            raise GroupUnreachable(
                f"rank {env.rank} could not join the process group at "
                f"{_bracket(env.master_addr)}:{env.master_port} (torch's timeout "
                f"{timeout_s:.0f} s: {first_line(exc).rstrip('.')}): a rank did not start, or "
                "this node cannot reach that address; see the other ranks' output") from None
        if one_each:
            check_own_gpus(env, str(torch.cuda.get_device_properties(device).uuid))
    return device


def rendezvous(env: DistEnv, timeout: timedelta) -> dict[str, Any]:
    """rendezvous is how init_process_group meets the other ranks: at MASTER_ADDR:PORT, and
    under torchrun's agent store in a store of this attempt's own. That store outlives the
    workers (torch >= 2.5 shares it, without a prefix per restart), and after `torchrun
    --max-restarts` restarted them a rank read the last attempt's gloo addresses (NCCL ids
    on GPUs) and waited to connect to a rank long dead (pytorch/pytorch#135712)."""
    if not env.agent_store:
        return {"init_method": f"tcp://{_bracket(env.master_addr)}:{env.master_port}"}
    from torch.distributed import PrefixStore, TCPStore

    if env.max_restarts and env.world_size > env.local_world_size and env.is_main:
        import logging  # (a warning only: the first attempt meets whatever the counts)

        logging.getLogger("pyrecover").warning(
            "torchrun --max-restarts %d over several nodes shares its agent's store with "
            "the workers, and the nodes' restart counts can differ after a restart (a "
            "membership change counts on no node): run torchrun as `python -m "
            "pyrecover.elastic_agent --stop-signal USR2 ...`, or set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, so each restart meets in a new store",
            env.max_restarts)
    return {"store": PrefixStore(f"pyrecover/attempt_{env.store_attempt}/pg", TCPStore(
        env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout))}


def node_name() -> str:
    """node_name is SLURM's name for this node (several can share a host), else the host's."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def shared_gpus(seen: list[tuple[str, str]]) -> str | None:
    """shared_gpus says which ranks share a GPU, from every rank's (node, GPU UUID) in rank
    order; None where each has its own."""
    first: dict[tuple[str, str], int] = {}
    for rank, where in enumerate(seen):
        if where in first:
            return (f"ranks {first[where]} and {rank} on {where[0]} see the same single GPU "
                    f"({where[1]}): each task needs one of its own; give the job a GPU per "
                    "task (gpus_per_node = tasks per node, or --gpus-per-task=1), or train on "
                    "the CPU (--set train.device=cpu)")
        first[where] = rank
    return None


def check_own_gpus(env: DistEnv, gpu: str) -> None:
    """check_own_gpus compares this rank's GPU (`gpu`, its UUID) with every other rank's on
    its node, once the group is up; where two share one, rank 0 raises DistError saying
    which, the others exit 2 (rank 0 says it once)."""
    message = shared_gpus(gather_objects((node_name(), gpu), env.world_size))
    if message is None:
        return
    teardown()
    if env.rank == 0:
        raise DistError(message)
    raise SystemExit(2)


def cpu_threads(environ: Mapping[str, str], cores: int, local_world_size: int) -> int:
    """cpu_threads is each CPU rank's intra-op thread count: `OMP_NUM_THREADS` where it is set
    (a positive integer), else this node's cores shared between its ranks.

    On a CPU the thread count decides how reductions are split, so it is part of what makes
    two runs bitwise equal (measured: 1 vs 2 threads per rank changed the gradient norm's
    last bits from step 5 of the tiny run). Pin it to compare runs launched differently, or
    to resume bit for bit on nodes with other core counts."""
    text = environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return max(1, cores // max(local_world_size, 1))


_set_up = False  # this process set up a trainer (setup), alone or in a group


def set_up_a_trainer() -> bool:
    """set_up_a_trainer tells whether this process set up a trainer (`setup`); its exit
    skips the interpreter's shutdown (`exit_now`)."""
    return _set_up


def exit_now(code: object) -> None:
    """exit_now ends a process that joined a process group, with `code` (a SystemExit's),
    after flushing its output, without the interpreter's shutdown.

    Call it once everything is saved and the group is left. A gloo worker thread that frees
    the last collective's tensors needs the GIL; once the interpreter has begun to shut down
    it cannot have it, and the C++ runtime aborts the whole process ("terminate called
    without an active exception", exit 134) after a run that finished: 1 run in 16 to 30 of
    a 2-rank tiny run on the 2-core VM, seen in a gdb backtrace of the core dump.

    A trainer alone (world size 1) ends the same way: the shutdown (torch's exit handlers,
    Inductor's compile workers, every module torn down) is time a restart waits for, 1.98 to
    5.20 s from a GPU trainer's last event to its end on the H200 machine (`bench restart
    --local`, gpt-125m; 0.63-0.81 s where it was killed instead)."""
    import logging

    if isinstance(code, str):
        sys.stderr.write(code + "\n")
    status = 0 if code is None else code if isinstance(code, int) else 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def teardown(then: Callable[[], None] | None = None) -> None:
    """teardown leaves the process group if one was joined; safe to call more than once.

    `then` runs once the group is gone, while this process still serves its store (rank 0's
    does, under srun and `train --nproc`): a peer blocked in a collective on a rank 0 that
    failed alone gets out only when rank 0 leaves, and then writes its heartbeat's `exit`
    there. Destroying the group frees the store, so it is held until `then` returns.

    Garbage is collected first: an object no longer reachable but not yet freed (in a
    reference cycle; a trainer runs with the collector off) may still hold gloo work or a
    group; freed later, during the interpreter's shutdown, it aborted a rank now and then
    ("terminate called without an active exception", exit -6 or 134).
    """
    import torch.distributed as tdist

    store = None
    try:
        if tdist.is_available() and tdist.is_initialized():
            gc.collect()
            with contextlib.suppress(Exception):  # torch keeps it private
                store = tdist.distributed_c10d._get_default_store()
            tdist.destroy_process_group()
    finally:
        if then is not None:
            then()
        del store


def gather_objects(obj: Any, world_size: int) -> list[Any]:
    """gather_objects returns every rank's `obj` on every rank ([obj] without a process group)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world_size
    tdist.all_gather_object(out, obj)
    return out


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr
