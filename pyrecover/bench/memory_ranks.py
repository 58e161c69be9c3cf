"""`pyrecover bench memory`'s two ranks: each builds the state, trains and snapshots it, and
rank 0 reports every figure's samples to the parent process.
"""

from __future__ import annotations

import os
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from pyrecover.bench.common import BenchError, Note
from pyrecover.bench.state import build_state
from pyrecover.bench.storage import remove

WORLD_SIZE = 2

SEQUENCE = 16  # tokens per training step of the big state: the step exercises, not measures

WARM_SNAPSHOTS = 3  # fill the three buffer sets once before measuring
FIGURES = ("torch_save", "snapshot_blocked", "exchange", "step", "step_snapshot",
           "persist_parallel", "persist_one_writer")


def _worker(rank: int, port: int, target: int, repeat: int, work: str, out) -> None:
    """_worker is one rank of the measurement; rank 0 puts the samples (or an error) on `out`."""
    from pyrecover import dist

    env = dist.DistEnv("torchrun", rank, WORLD_SIZE, rank, WORLD_SIZE, 0, "127.0.0.1", port)
    try:
        dist.setup(env, "cpu")
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed.*")
            samples = _measure(rank, target, repeat, Path(work), lambda text: (
                out.put(("note", text)) if rank == 0 else None))
        if rank == 0:
            out.put(("samples", samples))
    except BaseException:
        out.put(("error", f"rank {rank}: {traceback.format_exc()}"))
        raise
    finally:
        dist.teardown()


def _measure(rank: int, target: int, repeat: int, work: Path, note: Note) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pyrecover.checkpoint import CheckpointManager
    from pyrecover.rundir import RunDir

    note(f"building a GPT + AdamW state of about {target / 1e9:g} GB on each of 2 ranks")
    state = build_state(target, seed=0)  # the same on both ranks, as under DDP
    parts = state.parts
    ddp = DDP(parts.model)
    run = RunDir(work / "run")
    run.create()
    # A snapshot at every step, never a disk checkpoint: the interval is out of reach.
    manager = CheckpointManager(run, "memory", 10**9, 2, rank, WORLD_SIZE, parts,
                                torch.device("cpu"), False, snapshot_interval=1, replicas=2,
                                ranks_per_node=WORLD_SIZE)
    mode = manager.mode
    seconds: dict[str, list[float]] = {f: [] for f in FIGURES}
    generator = torch.Generator().manual_seed(rank)
    vocab = state.shape["vocab_size"]
    step = 0

    def train_step() -> tuple[float, float]:
        """train_step returns its seconds and how long it waited for a snapshot copy."""
        started = time.perf_counter()
        x = torch.randint(0, vocab, (1, SEQUENCE + 1), generator=generator)
        _, loss = ddp(x[:, :-1], x[:, 1:])
        loss.backward()
        fence = manager.before_update()  # as the loop does before the optimizer step
        parts.optimizer.step()
        parts.optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - started, fence

    def snapshot_step() -> tuple[float, float]:
        """snapshot_step trains one step and snapshots it: (seconds, seconds the loop waited
        for snapshots, including the wait for the previous one's copy in this step)."""
        nonlocal step
        took, fence = train_step()
        step += 1
        blocked = manager.at_step(step)
        return took + blocked, fence + blocked

    def slowest(value: float) -> float:
        both = torch.tensor([value], dtype=torch.float64)
        tdist.all_reduce(both, op=tdist.ReduceOp.MAX)
        return float(both.item())

    note("warming up: training steps and the first snapshots (buffers allocated once)")
    train_step()
    for _ in range(WARM_SNAPSHOTS):
        snapshot_step()
    for r in range(repeat):
        note(f"repeat {r + 1}/{repeat}: torch.save + fsync of the whole state by rank 0")
        tdist.barrier()
        if rank == 0:
            seconds["torch_save"].append(_torch_save(parts, work / "torch.pt"))
        tdist.barrier()
    note(f"{repeat} training step{'s' * (repeat != 1)} without, then {repeat + 1} with a "
         "snapshot each")
    mode.wait_staged()
    mode.wait()
    for _ in range(repeat):
        seconds["step"].append(slowest(train_step()[0]))
    snapshot_step()  # so that the first measured step waits for a copy as all the others
    for _ in range(repeat):
        took, blocked = snapshot_step()
        seconds["step_snapshot"].append(slowest(took))
        seconds["snapshot_blocked"].append(slowest(blocked))
    note(f"{repeat} replica exchanges with nothing else running")
    for _ in range(repeat):
        mode.wait_staged()
        mode.wait()
        step += 1
        manager.at_step(step)
        mode.wait_staged()
        started = time.perf_counter()
        mode.wait()
        seconds["exchange"].append(slowest(time.perf_counter() - started))
    snap = mode.current
    for r in range(repeat):
        note(f"repeat {r + 1}/{repeat}: persisting one snapshot by 2 ranks, then by 1")
        folder = work / f"persist-{rank}"
        folder.mkdir(exist_ok=True)
        tdist.barrier()
        seconds["persist_parallel"].append(slowest(_persist(mode, snap, folder, [rank])))
        if rank == 0:
            took = _persist(mode, snap, folder, sorted(snap.slices))
        tdist.barrier()
        if rank == 0:
            seconds["persist_one_writer"].append(took)
    persist_bytes = sum(t.numel() for t in snap.slices.values())
    mode.close()
    return {"seconds": seconds, "state_bytes": state.nbytes, "model": state.shape,
            "persist_bytes": persist_bytes, "threads": torch.get_num_threads()}


def _torch_save(parts, path: Path) -> float:
    import torch

    started = time.perf_counter()
    with path.open("wb") as f:
        torch.save({"model": parts.model.state_dict(),
                    "optimizer": parts.optimizer.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - started
    remove(path)
    return took


def _persist(mode, snap, folder: Path, slice_ids: list[int]) -> float:
    """_persist writes slices of one snapshot as memory mode does; the files go afterwards."""
    started = time.perf_counter()
    files = mode.write(folder, snap, slice_ids)
    took = time.perf_counter() - started
    for name in files:
        remove(folder / name)
    return took


def run_ranks(target: int, repeat: int, work: Path, note: Note) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from pyrecover import spawn

    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    port = spawn.free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, target, repeat, str(work), out),
                         name=f"pyrecover-bench-rank{r}") for r in range(WORLD_SIZE)]
    for p in procs:
        p.start()
    samples, error = None, None
    try:
        while samples is None and error is None:
            if not out.empty():
                kind, value = out.get()
                if kind == "note":
                    note(value)
                elif kind == "samples":
                    samples = value
                else:
                    error = value
            elif any(p.exitcode not in (None, 0) for p in procs):
                error = "; ".join(f"rank {r} exited with code {p.exitcode}"
                                  for r, p in enumerate(procs) if p.exitcode)
            else:
                time.sleep(0.05)
        for p in procs:
            p.join(timeout=None if error is None else 10)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    if error is not None:  # one line: the last of the rank's own error (its exception)
        last = next((line for line in reversed(str(error).splitlines()) if line.strip()), "")
        raise BenchError(f"a benchmark rank failed: {last.strip()}")
    assert samples is not None
    return samples
