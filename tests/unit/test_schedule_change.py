"""A restart with another train.min_lr, warmup_steps or max_steps trains its first step on the
new schedule: the restored optimizer held the lr the old schedule gave that step."""

from __future__ import annotations

import dataclasses

import torch

from pyrecover import config
from pyrecover.optim import apply_changes, build_optimizer, build_scheduler, lr_factor

CPU = torch.device("cpu")


def with_train(**train) -> config.Config:
    cfg = config.load(None)
    train = {"max_steps": 30, "warmup_steps": 5, **train}
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def restored(saved_cfg: config.Config, cfg: config.Config, steps: int = 10):
    """An optimizer and schedule of `cfg` loaded from those of `saved_cfg` after `steps`."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))
    optimizer = build_optimizer(model, saved_cfg, CPU)
    scheduler = build_scheduler(optimizer, saved_cfg)
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    state = (optimizer.state_dict(), scheduler.state_dict())
    optimizer = build_optimizer(model, cfg, CPU)
    scheduler = build_scheduler(optimizer, cfg)
    optimizer.load_state_dict(state[0])
    scheduler.load_state_dict(state[1])
    return optimizer, scheduler


def test_another_warmup_sets_the_lr_of_the_first_step_after_the_resume_and_says_so():
    old, new = with_train(), with_train(warmup_steps=20)
    optimizer, scheduler = restored(old, new)
    changed = apply_changes(optimizer, scheduler, new)
    want = new.train.lr * lr_factor(10, new)
    assert [g["lr"] for g in optimizer.param_groups] == [want, want]
    assert changed == [f"the schedule's lr at step 11: {old.train.lr * lr_factor(10, old):g} "
                       f"-> {want:g} (train.min_lr, warmup_steps or max_steps)"]


def test_a_raised_max_steps_takes_the_new_cosine_from_the_first_step_on():
    old, new = with_train(), with_train(max_steps=60)
    optimizer, scheduler = restored(old, new, steps=30)  # a finished run, at min_lr
    assert apply_changes(optimizer, scheduler, new)
    assert optimizer.param_groups[0]["lr"] == new.train.lr * lr_factor(30, new)


def test_a_restart_that_changes_nothing_leaves_the_optimizer_as_it_was():
    cfg = with_train()
    optimizer, scheduler = restored(cfg, cfg)
    before = optimizer.state_dict()
    assert apply_changes(optimizer, scheduler, cfg) == []
    assert optimizer.state_dict()["param_groups"] == before["param_groups"]


def test_a_raised_lr_with_a_shorter_schedule_says_the_lower_lr_the_step_now_trains_at():
    """lr 0.001 -> 0.002 with max_steps 300 -> 60 at step 53: the start said only the lr's
    rise, yet step 54 trained at a tenth of the lr before it."""
    old, new = with_train(max_steps=300), with_train(max_steps=60, lr=0.002)
    optimizer, scheduler = restored(old, new, steps=53)
    changed = apply_changes(optimizer, scheduler, new)
    before, after = old.train.lr * lr_factor(53, old), new.train.lr * lr_factor(53, new)
    assert after < before / 2
    assert changed == ["train.lr: 0.001 -> 0.002",
                       f"the schedule's lr at step 54: {before:g} -> {after:g}"]
    assert optimizer.param_groups[0]["lr"] == after


def test_a_new_lr_says_the_lr_its_resumed_step_trains_at():
    """min_lr is absolute: doubling the lr does not double the step's lr."""
    old, new = with_train(), with_train(lr=0.002)
    optimizer, scheduler = restored(old, new)
    after = 0.002 * lr_factor(10, new)
    assert apply_changes(optimizer, scheduler, new) == [
        "train.lr: 0.001 -> 0.002",
        f"the schedule's lr at step 11: {0.001 * lr_factor(10, old):g} -> {after:g}"]
    assert optimizer.param_groups[0]["lr"] == after
