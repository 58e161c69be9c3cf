"""The loop's guard against non-finite steps, in its two forms: the fused optimizer skipping
the update on the device (the host reads the step's numbers a step later, so it never waits
for the device to queue the next one) and the host reading both numbers before the update.
They must be the same run, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
from helpers import TINY

from pyrecover import config as config_mod
from pyrecover import preempt
from pyrecover.checkpoint import CheckpointManager
from pyrecover.checkpoint.mode import Parts
from pyrecover.data import Batches, load_tokens
from pyrecover.loop import Loop, TrainingError, TrainState
from pyrecover.model import GPT, GPTConfig
from pyrecover.optim import build_optimizer, build_scheduler, skips_on_device
from pyrecover.rundir import RunDir, read_jsonl


def make_loop(tmp_path, corpus, name: str, on_device: bool, *sets: str) -> Loop:
    # Logged every 100 steps: tiny.yaml logs every step, and a logged step is read at once.
    cfg = config_mod.load(TINY, [f"data.path={corpus}", "train.log_interval=100", *sets])
    torch.manual_seed(cfg.train.seed)
    model = GPT(GPTConfig(**config_mod.to_dict(cfg)["model"]))
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, cfg)
    state = TrainState()
    run = RunDir(tmp_path / name)
    run.create()
    loop: Loop | None = None
    parts = Parts(model=model, optimizer=optimizer, scheduler=scheduler,
                  config=config_mod.to_dict(cfg),
                  train_state=lambda: loop.settled_state() if loop else state.to_dict(),
                  train_state_later=lambda: loop.state_later())
    c = cfg.checkpoint
    manager = CheckpointManager(run, c.mode, c.interval, c.keep, 0, 1, parts,
                                torch.device("cpu"), snapshot_interval=c.snapshot_interval)
    loop = Loop(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler,
                batches=Batches(load_tokens(cfg.data.path, cfg.data.column), cfg.model.block_size,
                                cfg.train.seed),
                manager=manager, run=run, rank=0, world_size=1, device=torch.device("cpu"),
                state=state)
    assert loop.skip_on_device  # fused AdamW on the CPU too: the path a GPU takes
    loop.skip_on_device = on_device
    loop.on_step = lambda step: loop.unread.append(loop.pending is not None)
    loop.unread = []  # per step: was it still unread when the next began? (the device's way)
    return loop


def saved_train_states(run: RunDir) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text())["train_state"]
            for p in sorted(run.checkpoints.glob("step-*/manifest.json"))}


def bad_steps(run: RunDir) -> list[int]:
    return [e["step"] for e in read_jsonl(run.events) if e["event"] == "bad_step"]


def test_the_device_s_skip_of_a_non_finite_step_is_the_host_s_skip_bit_for_bit(
        tmp_path, corpus, monkeypatch):
    # Two bad steps up to a checkpoint (step 3), a good one, and more bad ones, the last at
    # the checkpoint of step 9 (faults.py): the skips, the count of bad steps in a row and
    # what the checkpoints hold must not depend on when the host reads a step.
    monkeypatch.setenv("PYRECOVER_NAN_AT_STEPS", "2,3,7,9")
    runs = {}
    for on_device in (True, False):
        loop = make_loop(tmp_path, corpus, f"device-{on_device}", on_device,
                         "train.max_steps=10", "checkpoint.interval=3", "checkpoint.keep=10")
        loop.run_steps()
        loop.manager.finish(loop.state.step)
        runs[on_device] = loop
    device, host = runs[True], runs[False]
    assert bad_steps(host.run) == bad_steps(device.run) == [2, 3, 7, 9]
    assert device.state == host.state
    saved = saved_train_states(device.run)
    assert saved == saved_train_states(host.run)
    assert [saved[f"step-{s}"]["bad_steps"] for s in (3, 6, 9)] == [2, 0, 1]
    for a, b in zip(device.model.state_dict().values(), host.model.state_dict().values(),
                    strict=True):
        assert torch.equal(a, b)
    for a, b in zip(device.optimizer.state.values(), host.optimizer.state.values(),
                    strict=True):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert {int(s["step"]) for s in device.optimizer.state.values()} == {6}  # 10 - 4 skipped
    assert sum(device.unread) >= 5 and not any(host.unread)


@pytest.mark.parametrize("in_thread", [True, False], ids=["copy-thread", "caller"])
def test_a_snapshot_every_step_holds_the_settled_state_without_waiting_for_the_step(
        tmp_path, corpus, monkeypatch, in_thread):
    """Memory mode snapshotting every step takes each step's count of bad steps once the
    snapshot's copy is done (the loop's `state_later`), not by reading the step first: every
    snapshot holds what it holds where the host reads each step before its update, and only
    the disk save at the end asks for the settled state. The copy runs in the copier's thread
    (as on a GPU, and for a large slice on a CPU) or in the loop's (a small CPU slice)."""
    monkeypatch.setenv("PYRECOVER_NAN_AT_STEPS", "2,3,7,9")
    held, loops, threads = {}, {}, set()
    for on_device in (True, False):
        loop = loops[on_device] = make_loop(
            tmp_path, corpus, f"device-{on_device}", on_device, "train.max_steps=10",
            "checkpoint.mode=memory", "checkpoint.snapshot_interval=1",
            "checkpoint.interval=100")
        mode = loop.manager.mode
        if in_thread:
            mode.background_copy_bytes = 0
        seen = held[on_device] = []
        settled = loop.settled_state
        loop.settled_asked = []
        monkeypatch.setattr(loop, "settled_state", lambda settled=settled, loop=loop: (
            loop.settled_asked.append(loop.state.step), settled())[1])

        def count(target, step, meta, count=mode._count, seen=seen):
            seen.append((step, dict(meta["train"])))  # each snapshot as it comes to count
            count(target, step, meta)

        def post(target, step, meta, post=mode._post):  # where the train state is read
            threads.add(threading.current_thread().name.startswith("pyrecover-stage"))
            post(target, step, meta)
        monkeypatch.setattr(mode, "_count", count)
        monkeypatch.setattr(mode, "_post", post)
        loop.run_steps()
        loop.manager.finish(loop.state.step)
    assert held[True] == held[False]
    assert [step for step, _ in held[True]] == list(range(1, 11))
    assert [t["bad_steps"] for _, t in held[True]] == [0, 1, 2, 0, 0, 0, 1, 0, 1, 0]
    assert [t["step"] for _, t in held[True]] == list(range(1, 11))
    assert set(loops[True].settled_asked) == {10}  # the final save's, not a snapshot's
    assert threads == {in_thread}


def test_an_async_dcp_save_holds_the_settled_state_without_waiting_for_the_step(
        tmp_path, corpus, monkeypatch):
    """An asynchronous DCP save takes the step's count of bad steps from its own thread,
    after its copy (manager._start, `state_later`), instead of making the loop wait for the
    step (on a GPU the device drained at every save: blocked per save 0.018 s -> 0.057 s on
    the H200 once the loop itself stopped reading each step). Every checkpoint holds, in its
    manifest and in extra.json, what the host's way holds; only the final save asks for the
    settled state."""
    monkeypatch.setenv("PYRECOVER_NAN_AT_STEPS", "2,3,7,9")
    loops = {}
    for on_device in (True, False):
        loop = loops[on_device] = make_loop(
            tmp_path, corpus, f"device-{on_device}", on_device, "train.max_steps=10",
            "checkpoint.mode=dcp", "checkpoint.async_save=true", "checkpoint.interval=3",
            "checkpoint.keep=10")
        settled = loop.settled_state
        loop.settled_asked = []
        monkeypatch.setattr(loop, "settled_state", lambda settled=settled, loop=loop: (
            loop.settled_asked.append(loop.state.step), settled())[1])
        loop.run_steps()
        loop.manager.finish(loop.state.step)
    device, host = loops[True].run, loops[False].run
    saved = saved_train_states(device)
    assert saved == saved_train_states(host)
    assert [saved[f"step-{s}"]["bad_steps"] for s in (3, 6, 9, 10)] == [2, 0, 1, 0]
    for step, train in saved.items():  # extra.json, which a resume reads, says the same
        assert json.loads((device.checkpoints / step / "extra.json").read_text())[
            "train"] == train
    assert loops[True].settled_asked == [10]  # the final save's, none of the three before
    assert sum(loops[True].unread) >= 5


@pytest.mark.parametrize("on_device", [True, False])
def test_too_many_bad_steps_in_a_row_end_the_run_at_the_same_step_either_way(
        tmp_path, corpus, monkeypatch, on_device):
    monkeypatch.setenv("PYRECOVER_NAN_AT_STEPS", "2,4,5,6,7,8")
    loop = make_loop(tmp_path, corpus, "run", on_device, "train.max_steps=30",
                     "train.max_bad_steps=3")
    with pytest.raises(TrainingError, match="3 consecutive steps"):
        loop.run_steps()
    assert bad_steps(loop.run) == [2, 4, 5, 6]
    assert loop.state.step == (6 if on_device else 5)  # the device's way reads 6 a step later


@pytest.mark.parametrize("on_device", [True, False])
def test_a_checkpoint_that_counts_the_last_bad_step_allowed_ends_the_run_there(
        tmp_path, corpus, monkeypatch, on_device):
    """Step 3 is read only when its checkpoint records the count (the device's way): the run
    must end at that step, not train step 4 first."""
    monkeypatch.setenv("PYRECOVER_NAN_AT_STEPS", "2,3")
    loop = make_loop(tmp_path, corpus, "run", on_device, "train.max_steps=30",
                     "train.max_bad_steps=2", "checkpoint.interval=3")
    with pytest.raises(TrainingError, match="2 consecutive steps"):
        loop.run_steps()
    assert loop.state.step == (3 if on_device else 2)
    assert {int(s["step"]) for s in loop.optimizer.state.values()} == {1}  # step 4 never ran


@pytest.mark.parametrize("on_device", [True, False])
def test_a_stop_on_the_last_bad_step_allowed_ends_the_run_without_a_stop_checkpoint(
        tmp_path, corpus, monkeypatch, on_device):
    """A signal at step 3, whose NaN reaches train.max_bad_steps: the run ends there with the
    guard's error and writes no stop checkpoint a requeued job would go on from."""
    monkeypatch.setenv("PYRECOVER_NAN_AT_STEPS", "2,3")
    loop = make_loop(tmp_path, corpus, "run", on_device, "train.max_steps=30",
                     "train.max_bad_steps=2", "checkpoint.interval=10")
    flag = preempt.StopFlag().install(("SIGUSR2",))
    loop.stopper = preempt.Stopper(flag, preempt.Deadline(None), 0, 1)
    loop.on_step = lambda step: step == 3 and os.kill(os.getpid(), signal.SIGUSR2)
    try:
        with pytest.raises(TrainingError, match="2 consecutive steps"):
            loop.run_steps()
    finally:
        flag.uninstall()
    assert not list(loop.run.checkpoints.glob("step-*"))


def test_a_loaded_state_keeps_the_fused_optimizer(tmp_path, corpus):
    """An older version saved its CPU optimizer state unfused (`fused: None` in each group);
    `load_state_dict` would take that over, and the loop would lose its on-device skip."""
    cfg = config_mod.load(TINY, [f"data.path={corpus}"])
    model = GPT(GPTConfig(**config_mod.to_dict(cfg)["model"]))
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    saved = optimizer.state_dict()
    for group in saved["param_groups"]:
        group["fused"], group["foreach"] = None, True
    optimizer.load_state_dict(saved)
    assert skips_on_device(optimizer)
    assert all(g["foreach"] is None for g in optimizer.param_groups)


class DeviceEvent:
    """Stands in for the CUDA event a step's numbers come back with (tests/gpu has the real
    one): its wait notes the watchdog's phase then."""

    def __init__(self, watchdog) -> None:
        self.watchdog, self.phases = watchdog, []

    def synchronize(self) -> None:
        self.phases.append(self.watchdog.current)


def test_the_host_waiting_for_the_device_is_phase_device_and_then_the_phase_before(
        tmp_path, corpus):
    """On a GPU a rank whose peer is stuck in a collective waits here, for its device: had it
    stayed `optimizer`, every such rank's node would be blamed and excluded."""
    from pyrecover.loop import Outcome

    loop = make_loop(tmp_path, corpus, "device", True)
    loop.watchdog.phase("optimizer", 3)
    event = DeviceEvent(loop.watchdog)
    assert loop._settle(Outcome(3, torch.tensor([2.5, 1.0]), event))
    assert event.phases == ["device"] and loop.watchdog.current == "optimizer"
    assert loop.last == (2.5, 1.0)
