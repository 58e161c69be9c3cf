"""An asynchronous DCP save copies the state in the background; the next update must not leak
into it, and the loop is charged for any wait."""

from __future__ import annotations

import os
import struct
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, store
from pyrecover.model import GPT, GPTConfig
from pyrecover.rundir import RunDir


@pytest.fixture(autouse=True)
def _no_process_group_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def resident_share(tensor: torch.Tensor) -> float:
    """resident_share is the share of the pages under `tensor` that are in memory (the
    "present" bit of each page's entry in /proc/self/pagemap)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first = tensor.data_ptr() // page
    last = (tensor.data_ptr() + tensor.nbytes - 1) // page
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        raw = pagemap.read((last - first + 1) * 8)
    entries = struct.unpack(f"{len(raw) // 8}Q", raw)
    return sum(e >> 63 for e in entries) / len(entries)


class SlowCopy:
    """Stands in for a slow device-to-host copy: the staging copy waits until the loop asks
    for it (the fence before the optimizer step), so it is still in flight until then however
    loaded the machine is. `copied_in` names the thread that copied."""

    def __init__(self, stager) -> None:
        self.copier = stager.copier
        self.copy_real, self.fence_real = self.copier._copy, self.copier.fence
        self.gate = threading.Event()
        self.copied_in: list[str] = []

    def __enter__(self):
        def late(*args, **kwargs):
            assert self.gate.wait(60), "the loop never fenced the copy"
            self.copied_in.append(threading.current_thread().name)
            return self.copy_real(*args, **kwargs)

        def fence() -> None:
            self.gate.set()
            self.fence_real()
        self.copier._copy, self.copier.fence = late, fence
        return self

    def __exit__(self, *exc) -> None:
        self.copier._copy, self.copier.fence = self.copy_real, self.fence_real


def test_an_update_right_after_an_async_save_never_reaches_that_save(tmp_path):
    state = build_state(2_000_000)  # a small GPT + AdamW with every optimizer slot filled
    parts = state.parts
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 2, 2, 0, 1, parts, torch.device("cpu"), True)
    saved = {k: v.clone() for k, v in parts.model.state_dict().items()}
    with SlowCopy(manager.mode.stager) as slow:
        manager.at_step(2)
        assert not slow.copied_in  # at_step returned with the copy still to come
        waited = manager.before_update()  # what the loop calls before optimizer.step
    assert slow.copied_in and slow.copied_in[0] != threading.main_thread().name
    assert waited > 0  # the copy was not done: the loop waited, and is charged for it
    for p in parts.model.parameters():  # the update the save must not see
        p.data.add_(1.0)
    manager.finish(2)
    ckpt = store.verify(run.checkpoints / "step-2")
    fresh = {"model": GPT(GPTConfig(**state.shape)).state_dict()}
    dcp.load(fresh, checkpoint_id=str(ckpt.path), no_dist=True)
    for key, value in fresh["model"].items():
        assert torch.equal(value, saved[key]), key
    events = [e for e in run.read_events() if e["event"] == "checkpoint"]
    assert events[-1]["blocked"] >= waited


def test_staging_reuses_its_buffers_and_holds_the_values_of_the_moment_it_copied():
    from pyrecover.checkpoint.staging import StateStager

    g = torch.Generator().manual_seed(0)
    live = {"model": {"w": torch.randn(64, 32, generator=g), "t": torch.randn(8, generator=g)[::2]},
            "optim": {"state": {"w": {"step": torch.tensor(3.0)}},
                      "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": ["w"]}]}}
    stager = StateStager(torch.device("cpu"))
    try:
        first = stager.stage(live).result()
        expect = {"w": live["model"]["w"].clone(), "t": live["model"]["t"].clone()}
        live["model"]["w"].add_(1.0)  # the optimizer's next update
        live["optim"]["param_groups"][0]["lr"] = 0.2  # the scheduler's
        assert torch.equal(first["model"]["w"], expect["w"])
        assert torch.equal(first["model"]["t"], expect["t"]) and first["model"]["t"].is_contiguous()
        assert first["optim"]["param_groups"][0] == {"lr": 0.1, "betas": (0.9, 0.95),
                                                     "params": ["w"]}
        ptr = first["model"]["w"].data_ptr()
        second = stager.stage(live).result()
        assert second["model"]["w"].data_ptr() == ptr  # the same memory, no fresh allocation
        assert torch.equal(second["model"]["w"], live["model"]["w"])
        assert second["optim"]["param_groups"][0]["lr"] == 0.2
        assert second["optim"]["state"]["w"]["step"].item() == 3.0
        live["model"]["tied"] = live["model"]["w"]  # tied weights: one buffer, one copy
        tied = stager.stage(live).result()
        assert tied["model"]["tied"] is tied["model"]["w"]
        live["model"]["w"] = torch.zeros(10)  # a tensor that changed shape gets a new buffer
        assert torch.equal(stager.stage(live).result()["model"]["w"], torch.zeros(10))
    finally:
        stager.close()


def test_staged_state_is_plain_tensors_and_keeps_any_other_value():
    """DCP on CUDA once failed every save after the first inside torch's stager, deep-copying a
    class object in the state (KeyError: <class 'type'>). Ours copies such values as they are,
    and hands DCP plain tensors, never parameters."""
    from pyrecover.checkpoint.staging import StateStager

    model = torch.nn.Linear(4, 3)
    live = {"model": dict(model.named_parameters()),
            "extra": {"kind": torch.nn.Linear, "dtype": torch.bfloat16, "none": None}}
    stager = StateStager(torch.device("cpu"))
    try:
        for _ in range(3):  # every save, not only the first
            staged = stager.stage(live).result()
            assert type(staged["model"]["weight"]) is torch.Tensor
            assert torch.equal(staged["model"]["weight"], model.weight.detach())
            assert staged["extra"] == {"kind": torch.nn.Linear, "dtype": torch.bfloat16,
                                       "none": None}
    finally:
        stager.close()


def test_a_failed_copy_is_reported_by_whoever_reads_it_and_the_fence_never_raises():
    from pyrecover.checkpoint.staging import Copier

    copier = Copier(torch.device("cpu"))
    try:
        target, source = torch.empty(3), torch.arange(3.0)

        def broken() -> None:
            raise OSError("disk went away")

        copier.start([target], [source], then=broken)
        copier.fence()  # the loop goes on; the save's result carries the error
        with pytest.raises(OSError, match="disk went away"):
            copier.wait()
        assert torch.equal(target, source)
        done = copier.start([target], [source * 2], then=lambda: "landed", background=False)
        assert done.done() and copier.wait() == "landed"
        assert torch.equal(target, source * 2)
    finally:
        copier.close()


def test_a_file_removed_from_a_save_in_flight_fails_that_save_instead_of_committing_it(tmp_path):
    # What a second run on the same directory used to do: its clean-up removed this run's
    # in-flight folder, and the save committed with only the files still there.
    parts = build_state(200_000).parts
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 2, 2, 0, 1, parts, torch.device("cpu"), True)
    with SlowCopy(manager.mode.stager):
        manager.at_step(2)
        (manager.inflight.pending.tmp / "rng-0.pt").unlink()  # before the write is durable
        manager.before_update()
    manager.finish(2)  # the failed save is discarded; finish writes step 2 once more
    failed = [e for e in run.read_events() if e["event"] == "checkpoint_failed"]
    assert len(failed) == 1 and "rng-0.pt is missing" in failed[0]["reason"]
    assert "rng-0.pt" in store.verify(run.checkpoints / "step-2").manifest["files"]



@pytest.mark.parametrize("mode", ["dcp", "memory"])
def test_the_first_save_finds_its_host_buffers_allocated_at_the_first_step(tmp_path, mode):
    """Pinned host buffers take about a second per 1.6 GB to allocate on a GPU machine: they
    are allocated in the background from the first step boundary on, and the first save or
    snapshot copies into them instead of allocating its own in the loop's time."""
    parts = build_state(8_000_000).parts
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, mode, 4, 2, 0, 1, parts, torch.device("cpu"), True,
                                snapshot_interval=2 if mode == "memory" else 0)

    def held() -> list[torch.Tensor]:
        if mode == "dcp":
            manager.mode.stager.copier.allocated()
            return list(manager.mode.stager._buffers.values())
        manager.mode.copier.allocated()
        sets = (manager.mode.current, manager.mode.previous, manager.mode.spare)
        return [b for s in sets for b in s.buffers.values()]

    def buffers() -> set[int]:
        return {b.data_ptr() for b in held()}

    assert not buffers()
    manager.at_step(1)  # the first step boundary: nothing is due, the buffers are prepared
    prepared = buffers()
    # ... and resident: a CPU buffer's pages are mapped at their first write, which made the
    # first copy into them 7x slower than the next ones, in the loop's time.
    large = [b for b in held() if b.nbytes >= 1 << 18]
    assert large and all(resident_share(b) == 1.0 for b in large)
    tensors = sum(1 for _ in parts.model.parameters()) * 4  # weight, exp_avg, exp_avg_sq, step
    assert len(prepared) == (3 if mode == "memory" else tensors)
    for step in (2, 3, 4):  # memory: snapshots at 2 and 4, a disk save at 4; dcp: a save at 4
        manager.at_step(step)
        assert buffers() == prepared  # reused, nothing allocated in the loop's time
        manager.before_update()
    manager.finish(4)
    assert store.verify(run.checkpoints / "step-4").step == 4


def test_buffers_wait_for_the_optimizer_s_state_and_never_make_one_up(tmp_path):
    """A first step skipped for a non-finite loss leaves AdamW without state; asking DCP for
    its state dict then would run a step of its own (torch's _init_optim_state). The buffers
    wait for the first real update instead."""
    from pyrecover.checkpoint.mode import Parts

    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    parts = Parts(model=model, optimizer=optimizer,
                  scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                  config={}, train_state=lambda: {"step": 0, "tokens_seen": 0,
                                                   "data_position": 0, "bad_steps": 0})
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 10, 2, 0, 1, parts, torch.device("cpu"), True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    manager.at_step(1)  # the update of step 1 was skipped: nothing to prepare yet
    manager.mode.stager.copier.allocated()
    assert optimizer.state == {} and manager.mode.stager._buffers == {}
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    x = torch.randint(0, 64, (2, 16))
    model(x, x)[1].backward()
    optimizer.step()
    manager.at_step(2)  # now it has state: the buffers are prepared
    manager.mode.stager.copier.allocated()
    assert manager.mode.stager._buffers
    assert {int(s["step"]) for s in optimizer.state.values()} == {1}  # one real step only
    manager.finish(2)


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_failing_as_it_starts_leaves_nothing_for_the_garbage_collector(
        tmp_path, monkeypatch, async_save):
    """A trainer runs with the collector off, and what only it would free (this mode, its
    process group, the state) was freed during the interpreter's shutdown instead, where
    freeing gloo's work aborted a rank now and then."""
    import errno
    import gc
    import weakref

    from pyrecover.checkpoint import dcp as dcp_mode

    def full_disk(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(dcp_mode, "write_rng", full_disk)
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 2, 2, 0, 1, build_state(200_000).parts,
                                torch.device("cpu"), async_save)
    gc.collect()
    gc.disable()
    try:
        manager.at_step(2)
        manager.commit_inflight()
        assert manager.failed_step == 2 and "No space left" in manager.last_error
        manager.mode.close()
        gone = weakref.ref(manager.mode)
        del manager
        assert gone() is None
    finally:
        gc.enable()


def test_an_auto_interval_counts_from_a_save_s_start_so_a_write_in_flight_is_not_due_again(
        tmp_path):
    """With `checkpoint.interval: auto` the next save used to be due `interval` steps after the
    previous one committed: while an asynchronous write was still going, the very next step
    was due too, waited for the write and saved again."""
    from pyrecover.checkpoint.interval import AutoInterval

    parts = build_state(200_000).parts
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "dcp", 2, 2, 0, 1, parts, torch.device("cpu"), True)
    manager.auto = AutoInterval(mtbf_s=3600.0, max_steps=1000, steps=2)
    written, real_save = threading.Event(), manager.mode._save

    def slow_disk(state, writer) -> None:  # the write outlasts the steps below
        assert written.wait(30), "the write was never let through"
        real_save(state, writer)

    manager.mode._save = slow_disk
    for step in range(1, 5):  # the attempt's first step is 1: step 3 is due, step 4 is not
        manager.at_step(step)
        manager.before_update()
        if step >= 3:
            assert manager.inflight is not None and manager.inflight.pending.step == 3
    written.set()
    manager.commit_inflight()
    assert manager.auto.step_s > 0  # the steps' own time, from the first step to the save
    manager.finish(5)
    steps = [e["step"] for e in run.read_events() if e["event"] == "checkpoint"]
    assert steps == [3, 5]
