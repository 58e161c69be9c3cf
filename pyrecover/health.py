"""The health check every task runs before training: seconds, so a bad node is found first.

`local_checks` runs on each task before the process group: the GPUs the task expects are
visible and a small matrix product on its GPU matches the CPU's; host memory and the
checkpoints' filesystem has room for a checkpoint; the run folder and checkpoints/ each take
a small write + fsync within a bound. `first_collective` then runs one all-reduce over every rank
within a bound. A failure is a `Failure` naming the node and the check; the trainer writes
it as one line and a `health` event and exits with `EXIT_HEALTH`, which the job script reads
to exclude the node (pyrecover/slurm/render.py).

Each check takes what it needs as arguments, so each is testable alone; `before_group` and
`after_group` are the trainer's two calls.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pyrecover import faults
from pyrecover.preempt import EXIT_HEALTH
from pyrecover.rundir import RunDir

if TYPE_CHECKING:
    from pyrecover.config import Config
    from pyrecover.dist import DistEnv

CHECKS = ("gpu", "memory", "storage_space", "storage_write", "collective")
"""Every check's name, as written in `health` events and the job script's bad-nodes reasons."""
NODE_CHECKS = ("gpu", "memory", "storage_write")
"""The checks whose failure is the node's own: the job script excludes the node for these
(slurm/blocks.py). A full storage is shared by every node, and a collective that does not
complete names no culprit."""

WRITE_BOUND_S = 10.0  # a 4 KiB write + fsync: milliseconds on a healthy filesystem
COLLECTIVE_BOUND_S = 60.0  # every rank has joined the group by then; one tiny all-reduce
BYTES_PER_PARAM = 16  # fp32 weights, gradients and two AdamW moments
CHECKPOINT_BYTES_PER_PARAM = 12  # fp32 weights and two moments (gradients are not saved)


@dataclass(frozen=True)
class Failure:
    """One failed check: which, where, and what was wrong."""

    check: str
    node: str
    rank: int
    detail: str

    def line(self) -> str:
        """line is the one line a person reads in the job log."""
        return (f"pyrecover: health check failed on node {self.node} (rank {self.rank}): "
                f"{self.check}: {self.detail}")


def approx_params(n_layer: int, n_embd: int, vocab_size: int, block_size: int) -> int:
    """approx_params is a GPT's parameter count to within a few percent (12 L d^2 + embeddings)."""
    return 12 * n_layer * n_embd * n_embd + (vocab_size + block_size) * n_embd


def state_bytes(params: int, mode: str, replicas: int, local_ranks: int,
                on_cpu: bool = True, world_size: int | None = None) -> int:
    """state_bytes is the host memory this node's tasks need: the training state where it
    trains on the CPU, and memory mode's snapshots on any device (on a GPU they are host
    memory too). `world_size` defaults to one node's tasks."""
    world_size = world_size or local_ranks
    snapshots = (snapshot_bytes(params, replicas, world_size, local_ranks)
                 if mode == "memory" else 0)
    return (local_ranks * params * BYTES_PER_PARAM if on_cpu else 0) + snapshots


def snapshot_bytes(params: int, replicas: int, world_size: int, local_ranks: int) -> int:
    """snapshot_bytes is memory mode's host buffers on a node of `local_ranks` tasks: each rank
    keeps three snapshot sets (the newest, the one before it and the one being filled:
    exchange.Snapshots), each set the slices the rank holds, which are min(replicas,
    world_size) (layout.holders), of 1/world_size of the state each."""
    held = min(max(1, replicas), world_size)
    state = params * CHECKPOINT_BYTES_PER_PARAM
    return 3 * held * local_ranks * -(-state // world_size)


def too_few_gpus(seen: int, local_ranks: int) -> str | None:
    """too_few_gpus: a task that sees `seen` GPUs on a node of `local_ranks` tasks is short of
    them. One is enough: the task's own, where SLURM shows each task only its GPU
    (--gpus-per-task, --gpu-bind); whether two tasks share it is settled once the group is up
    (dist.check_own_gpus)."""
    if seen == 0 or 1 < seen < local_ranks:
        return f"{seen} GPU(s) visible, this node's {local_ranks} tasks need one each"
    return None


def check_gpu(device_kind: str, local_rank: int, local_ranks: int) -> str | None:
    """check_gpu: on CUDA, the task's GPUs are visible and a matmul on its GPU matches the CPU's."""
    if device_kind != "cuda":
        return None  # the CPU path has no GPU to check
    import torch

    seen = torch.cuda.device_count()
    short = too_few_gpus(seen, local_ranks)
    if short is not None:
        return short
    index = local_rank % seen
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(64, 64, generator=gen)
    b = torch.randn(64, 64, generator=gen)
    want = a @ b
    try:
        got = (a.to(f"cuda:{index}") @ b.to(f"cuda:{index}")).cpu()
    except RuntimeError as exc:  # a GPU that errors (Xid, ECC) fails here
        return f"GPU {index} failed a 64x64 matmul: {str(exc).splitlines()[0][:200]}"
    # TF32 (if enabled) keeps 10 mantissa bits: 1e-2 relative is far above its error and far
    # below a broken device's.
    if not torch.allclose(got, want, rtol=1e-2, atol=1e-2):
        worst = (got - want).abs().max().item()
        return f"GPU {index} computed a 64x64 matmul wrong (max error {worst:.3g})"
    return None


def check_memory(need: int, available: int | None = None) -> str | None:
    """check_memory: MemAvailable (from /proc/meminfo unless given) covers `need` bytes."""
    if available is None:
        available = mem_available()
    if available is None or available >= need:
        return None
    return (f"{_gib(available)} host memory available, the configured state needs "
            f"{_gib(need)}")


def mem_available() -> int | None:
    """mem_available is /proc/meminfo's MemAvailable in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_storage_space(path: Path, need: int) -> str | None:
    """check_storage_space: the filesystem of `path` has `need` bytes free."""
    free = shutil.disk_usage(path).free
    if free >= need:
        return None
    return f"{_gib(free)} free under {path}, a checkpoint needs {_gib(need)}"


def check_storage_write(folder: Path, tag: str, bound_s: float = WRITE_BOUND_S) -> str | None:
    """check_storage_write: 4 KiB written and fsynced into `folder` within `bound_s` seconds."""
    path = folder / f".health-{tag}-{os.getpid()}"
    began = time.monotonic()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, bytes(4096))
            os.fsync(fd)
        finally:
            os.close(fd)
            path.unlink(missing_ok=True)
    except PermissionError as exc:  # this user's access, not the node's or the storage's:
        # no requeue or other node gives it; the CLI says whose folder, exit 2 (cli/app.py)
        raise PermissionError(exc.errno, exc.strerror, str(folder)) from None
    except OSError as exc:
        return f"cannot write and fsync a file in {folder}: {exc.strerror or exc}"
    took = time.monotonic() - began
    if took > bound_s:
        return f"a 4 KiB write + fsync in {folder} took {took:.1f}s (bound {bound_s:.0f}s)"
    return None


def local_checks(checks: dict[str, Callable[[], str | None]], node: str, rank: int,
                 injected: str | None = None) -> Failure | None:
    """local_checks runs `checks` (name -> check) in order; the first failure, or None.

    `injected` (pyrecover.faults.health_fault) names a check to fail on purpose.
    """
    for name, check in checks.items():
        try:
            detail = "fault injected (PYRECOVER_HEALTH_FAIL)" if name == injected else check()
        except PermissionError:  # the user's to fix (exit 2), not the node's (77)
            raise
        except OSError as exc:  # e.g. storage that is not a folder: the check fails, says why
            detail = f"{exc.strerror or exc}: {exc.filename}" if exc.filename else str(exc)
        if detail is not None:
            return Failure(name, node, rank, detail)
    return None


def first_collective(bound_s: float = COLLECTIVE_BOUND_S, value: float = 0.0) -> float | None:
    """first_collective all-reduces (max) `value` over every rank within `bound_s` seconds and
    returns the maximum; None where it did not complete in time. No group: `value`."""
    import datetime

    import torch
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64)
    work = tdist.all_reduce(t, op=tdist.ReduceOp.MAX, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=bound_s))
    except RuntimeError:
        return None
    return float(t.item())


def checks_for(cfg: Config, env: DistEnv, run: RunDir, device_kind: str
               ) -> dict[str, Callable[[], str | None]]:
    """checks_for is this task's local checks, in the order they run."""
    m = cfg.model
    params = approx_params(m.n_layer, m.n_embd, m.vocab_size, m.block_size)
    on_cpu = device_kind == "cpu"
    memory = state_bytes(params, cfg.checkpoint.mode, cfg.checkpoint.replicas,
                         env.local_world_size, on_cpu, env.world_size)
    return {
        "gpu": lambda: check_gpu(device_kind, env.local_rank, env.local_world_size),
        "memory": lambda: check_memory(memory),
        # One checkpoint in flight beside the kept ones: the space for one more, where the
        # saves go (checkpoints/ may be a link to another filesystem, e.g. a scratch one).
        "storage_space": lambda: check_storage_space(_saves_folder(run),
                                                     params * CHECKPOINT_BYTES_PER_PARAM),
        "storage_write": lambda: check_storage_writes(run, f"rank{env.rank}"),
    }


def _saves_folder(run: RunDir) -> Path:
    """_saves_folder is checkpoints/ where it is already made (every start makes it before
    the checks), else the run folder that will hold it."""
    return run.checkpoints if run.checkpoints.is_dir() else run.root


def check_storage_writes(run: RunDir, tag: str) -> str | None:
    """check_storage_writes: the run folder (events, metrics) and checkpoints/ (the saves)
    each take a write + fsync. A checkpoints/ that refuses writes under a writable run
    folder (a link to a read-only or full filesystem, other permissions) would otherwise
    train to the end with no checkpoint and fail only at its final save."""
    said = check_storage_write(run.root, tag)
    saves = _saves_folder(run)
    if said is None and saves != run.root:
        said = check_storage_write(saves, tag)
    return said


def before_group(cfg: Config, env: DistEnv, run: RunDir, device_kind: str, node: str) -> float:
    """before_group runs this task's local checks; returns their seconds, or reports the
    failure (one line on stderr, a `health` event) and exits with EXIT_HEALTH."""
    began = time.monotonic()
    failure = local_checks(checks_for(cfg, env, run, device_kind), node, env.rank,
                           faults.health_fault(node))
    if failure is not None:
        _fail(run, failure)
    return time.monotonic() - began


def after_group(run: RunDir, env: DistEnv, node: str, local_s: float,
                bound_s: float = COLLECTIVE_BOUND_S) -> None:
    """after_group runs the first collective; rank 0 records the passed check (`health`
    event, `ok`, the slowest task's local seconds), or any rank reports a collective that
    did not complete within `bound_s` and exits with EXIT_HEALTH."""
    began = time.monotonic()
    slowest = first_collective(bound_s, local_s)
    if slowest is None:
        _fail(run, Failure("collective", node, env.rank, f"the first all-reduce over "
                           f"{env.world_size} ranks did not complete in {bound_s:.0f}s"))
    elif env.rank == 0:
        run.event("health", ok=True, ranks=env.world_size, seconds=round(slowest, 3),
                  collective_seconds=round(time.monotonic() - began, 3))


def _fail(run: RunDir, failure: Failure) -> None:
    import sys

    print(failure.line(), file=sys.stderr, flush=True)
    if run.root.is_dir():
        run.event("health", ok=False, rank=failure.rank, node=failure.node,
                  check=failure.check, error=failure.detail)
    raise SystemExit(EXIT_HEALTH)


def _gib(n: int) -> str:
    """_gib is a size for people: GiB, or MiB below one GiB (a small disk's "0.00 GiB free,
    a checkpoint needs 0.00 GiB" said nothing)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
