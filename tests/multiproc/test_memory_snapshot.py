"""Memory mode's snapshot itself, on two real gloo ranks: what it holds, whatever the loop does
right after it, and what a survivor writes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
from helpers import run_ranks

from pyrecover.bench import state as bench
from pyrecover.checkpoint import memory, rng

pytestmark = pytest.mark.multiproc


def state_of(parts) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v.clone() for k, v in parts.model.state_dict().items()}
    names = {p: n for n, p in parts.model.named_parameters()}
    for p, per_param in parts.optimizer.state.items():
        for key, value in per_param.items():
            out[f"optim/{names[p]}/{key}"] = value.clone()
    return out


def restored(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    flat, meta = memory.assemble(folder, [p.name for p in folder.iterdir()])
    model, optim = memory.unflatten(flat, meta["layout"], meta.get("aliases"))
    out = {f"model/{k}": v for k, v in model.items()}
    for fqn, per_param in optim.items():
        out.update({f"optim/{fqn}/{k}": v for k, v in per_param.items()})
    return out, meta


def _scenario(rank: int, root: Path) -> None:
    parts = bench.build_state(8_000_000, seed=0).parts
    # Every slice is "large": the copy runs in a background thread, as for a big model.
    mode = memory.MemoryMode(rank, 2, torch.device("cpu"), replicas=2, background_copy_bytes=0)
    torch.manual_seed(100 + rank)
    before, before_rng = state_of(parts), rng.capture()
    mode.snapshot(1, parts, {"step": 1})
    # What the loop does next: the fence, then an optimizer step that changes every tensor.
    mode.wait_staged()
    for p in parts.model.parameters():
        p.grad = torch.ones_like(p)
    parts.optimizer.step()
    torch.rand(3)  # the RNG moves on too
    mode.snapshot(2, parts, {"step": 2})
    mode.wait_staged()
    mode.wait()
    assert (mode.current.step, mode.previous.step) == (2, 1)
    if rank == 1:  # leaves without taking part in step 3's exchange
        tdist.barrier()
        mode.close()
        return
    tdist.barrier()
    mode.snapshot(3, parts, {"step": 3})  # its replica from rank 1 never comes
    assert mode.persist_survivor(root) == [2, 1]  # never 3, which has no replica of slice 1
    got, meta = restored(root / f"{memory.SNAP_PREFIX}1")
    assert got.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(got[key], value), key
    assert meta["train"] == {"step": 1}
    assert meta["rngs"][0]["python"] == before_rng["python"]
    assert torch.equal(meta["rngs"][0]["torch"], before_rng["torch"])
    assert meta["rngs"][1] is not None  # rank 1's, received with its slice
    mode.close()  # its exchange with the rank that left fails now, before the group goes


def test_a_snapshot_holds_the_state_of_its_step_and_a_survivor_never_writes_a_partial_one(
        tmp_path):
    run_ranks(_scenario, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{memory.SNAP_PREFIX}1", f"{memory.SNAP_PREFIX}2"]


class StuckDeviceCopy:
    """Stands in for a CUDA snapshot copy that never lands: on the side stream it waits for the
    step's NCCL all-reduce, which never completes once a peer died in it, so the copy's thread
    waits in `event.synchronize()` for good. Here the CPU copy waits on `release` instead."""

    def __init__(self, copier) -> None:
        self.copier, self.copy_real = copier, copier._copy
        self.release = threading.Event()

    def __enter__(self) -> StuckDeviceCopy:
        def stuck(*args, **kwargs):
            self.release.wait()
            return self.copy_real(*args, **kwargs)
        self.copier._copy = stuck
        return self

    def __exit__(self, *exc) -> None:
        self.release.set()  # lets the copy's thread end, so the process can exit
        self.copier._copy = self.copy_real


def _stuck_copy(rank: int, root: Path) -> None:
    parts = bench.build_state(2_000_000, seed=0).parts
    mode = memory.MemoryMode(rank, 2, torch.device("cpu"), replicas=2, background_copy_bytes=0)
    at_step = {}
    for step in (1, 2):
        at_step[step] = state_of(parts)
        mode.snapshot(step, parts, {"step": step})
        mode.wait_staged()
        for p in parts.model.parameters():
            p.grad = torch.ones_like(p)
        parts.optimizer.step()
    mode.wait()
    tdist.barrier()
    if rank == 1:  # dies during step 3
        mode.close()
        return
    with StuckDeviceCopy(mode.copier):
        mode.snapshot(3, parts, {"step": 3})  # its copy never lands
        written, returned = [], threading.Event()
        threading.Thread(target=lambda: (written.extend(mode.persist_survivor(root)),
                                         returned.set()), daemon=True).start()
        assert returned.wait(60), "persist_survivor waited for a copy that never lands"
    mode.close()  # the released copy's exchange with the rank that left fails now
    assert written == [2, 1]  # never 3: its buffers were still being filled
    got, meta = restored(root / f"{memory.SNAP_PREFIX}2")
    assert meta["train"] == {"step": 2} and got.keys() == at_step[2].keys()
    for key, value in at_step[2].items():
        assert torch.equal(got[key], value), key


def test_a_survivor_whose_snapshot_copy_never_lands_still_persists_the_complete_ones(tmp_path):
    run_ranks(_stuck_copy, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{memory.SNAP_PREFIX}1", f"{memory.SNAP_PREFIX}2"]


def _spent_budget(rank: int) -> None:
    parts = bench.build_state(2_000_000, seed=0).parts
    mode = memory.MemoryMode(rank, 2, torch.device("cpu"), replicas=2)
    mode.snapshot(1, parts, {"step": 1})
    mode.wait()
    tdist.barrier()
    if rank == 1:  # alive, its connections open, but frozen: it never exchanges step 2
        tdist.barrier()  # until rank 0 is through
        mode.close()
        return
    mode.snapshot(2, parts, {"step": 2})
    mode.wait_staged()  # the copy landed; only the exchange is left, and it never completes
    failed: list[BaseException] = []
    returned = threading.Event()

    def spent() -> None:
        try:
            mode.wait(timeout=0.0)  # what a survivor's wait has left once its budget is spent
        except Exception as exc:  # noqa: BLE001 - the test looks at what it was
            failed.append(exc)
        returned.set()
    threading.Thread(target=spent, daemon=True).start()
    assert returned.wait(60), "a wait whose time was spent waited for the frozen peer"
    assert failed and mode.current.step == 1  # timed out; step 2 never counts
    tdist.barrier()
    mode.close()


def test_a_wait_whose_time_is_spent_never_waits_for_a_frozen_peer():
    """c10d reads a zero timeout as none: a survivor whose copy landed as its 2 s were up gave
    the exchange 0 s, and waited for a frozen (not dead) peer for good, so its snapshots were
    never persisted."""
    run_ranks(_spent_budget)
