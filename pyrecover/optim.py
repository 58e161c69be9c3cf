"""The optimizer and learning-rate schedule a run uses, built from its config.

One place, so the trainer and the checkpoint tools (which rebuild a run's optimizer to
convert a checkpoint) build exactly the same thing.
"""

from __future__ import annotations

import inspect
import math

import torch

from pyrecover.config import Config

# Devices with torch's fused AdamW kernel (one pass over each tensor): on the 2-core VM it
# updated an 80M-parameter model in 46 ms against 135-385 ms for the default foreach one.
FUSED_DEVICES = ("cuda", "cpu")


def _eager(name: str):
    """_eager is AdamW's method `name` as torch defines it, without the wrappers around it."""
    return inspect.unwrap(getattr(torch.optim.AdamW, name))


class AdamW(torch.optim.AdamW):
    """torch's AdamW, the same arithmetic, state and hooks, without two wrappers that matter
    only while torch.compile traces an optimizer, which no run does (a compiled run compiles
    the model): `torch._disable_dynamo` (add_param_group, zero_grad, state_dict,
    load_state_dict) and `_use_grad_for_differentiable` (step: grad off, a graph break). Each
    imports torch._dynamo at its first call, and that import (sympy and all) cost every
    eager start 1.0-1.1 s of CPU on a 2-core VM, before the first step and so in every
    restart. A run that compiles imports it anyway. `differentiable=True` is not offered."""

    add_param_group = _eager("add_param_group")
    zero_grad = _eager("zero_grad")
    state_dict = _eager("state_dict")
    load_state_dict = _eager("load_state_dict")
    _step = staticmethod(_eager("step"))

    def step(self, closure=None):  # what the wrapper does for a non-differentiable optimizer
        with torch.no_grad():
            return AdamW._step(self, closure)


def build_optimizer(model: torch.nn.Module, cfg: Config,
                    device: torch.device) -> torch.optim.Optimizer:
    """build_optimizer is AdamW with weight decay on matrices only (not norms or biases),
    fused on CUDA and CPU. A loaded state keeps this implementation (see keep_fused)."""
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    fused = device.type in FUSED_DEVICES or None
    optimizer = AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=fused)
    optimizer.register_load_state_dict_post_hook(lambda opt: keep_fused(opt, fused))
    return optimizer


def keep_fused(optimizer: torch.optim.Optimizer, fused: bool | None) -> None:
    """keep_fused gives every group back the implementation the run built: `load_state_dict`
    takes `fused` and `foreach` from the saved groups, so a checkpoint from a CPU run of an
    older version (not fused) would have made a GPU run slow, and the loop's on-device skip of
    a non-finite step (loop.py) needs the fused kernel. Their step counts go to the weights'
    device, where the fused kernel keeps them."""
    for group in optimizer.param_groups:
        group["fused"], group["foreach"] = fused, None if fused else group.get("foreach")
        if not fused:
            continue
        for p in group["params"]:  # the fused kernel counts steps on the weights' device;
            state = optimizer.state.get(p, {})  # load_state_dict left them where the saved
            step = state.get("step")  # groups' flags said (on the CPU for an unfused save)
            if isinstance(step, torch.Tensor) and step.device != p.device:
                state["step"] = step.to(device=p.device, dtype=torch.float32)


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """skips_on_device tells whether `optimizer.step()` honours `optimizer.found_inf` (a 0-dim
    float tensor on the parameters' device: 1 leaves parameters, moments and step counts as
    they were), as torch's fused Adam/AdamW do for the AMP grad scaler."""
    return bool(optimizer.param_groups) and all(g.get("fused") for g in optimizer.param_groups)


def lr_factor(step: int, cfg: Config) -> float:
    """lr_factor is the multiplier of train.lr at `step`: linear warmup, then cosine to min_lr."""
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    span = max(1, t.max_steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    floor = t.min_lr / t.lr
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: Config):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))


def apply_changes(optimizer: torch.optim.Optimizer, scheduler, cfg: Config) -> list[str]:
    """apply_changes makes a restored optimizer and schedule use the config's train.lr,
    weight_decay and betas where a restart changed them, and the lr its schedule gives the
    resumed step (train.min_lr, warmup_steps and max_steps shape it), and returns what changed
    (`train.lr: 0.001 -> 0.01`; [] leaves both untouched, so a resume stays bitwise).

    Loading the state restores the saved values: the schedule kept the old base lr while its
    factor used the new min_lr / lr, so a raised lr was ignored and the run ended below min_lr;
    and the first step after the resume trained at the lr the old schedule gave it (a
    finished run continued with a raised max_steps took that step at min_lr).
    """
    t = cfg.train
    decay = optimizer.param_groups[0]  # build_optimizer's: matrices, with weight decay
    was = {"train.lr": float(scheduler.base_lrs[0]),
           "train.weight_decay": float(decay["weight_decay"]),
           "train.beta1": float(decay["betas"][0]), "train.beta2": float(decay["betas"][1])}
    now = {"train.lr": t.lr, "train.weight_decay": t.weight_decay, "train.beta1": t.beta1,
           "train.beta2": t.beta2}
    changed = [f"{k}: {was[k]:g} -> {now[k]:g}" for k in was if was[k] != now[k]]
    factor = lr_factor(scheduler.last_epoch, cfg)
    if decay["lr"] != t.lr * factor:  # as LambdaLR computes it: bitwise. Said beside a new
        # train.lr too: min_lr is absolute, so the step's lr is not the old one scaled, and
        # with a shorter max_steps a raised lr can even lower it.
        changed.append(f"the schedule's lr at step {scheduler.last_epoch + 1}: "
                       f"{decay['lr']:g} -> {t.lr * factor:g}" + (
                           "" if changed else " (train.min_lr, warmup_steps or max_steps)"))
    if not changed:
        return []
    scheduler.base_lrs = [t.lr] * len(optimizer.param_groups)
    for i, group in enumerate(optimizer.param_groups):
        group["initial_lr"], group["lr"] = t.lr, t.lr * factor
        group["betas"] = (t.beta1, t.beta2)
        if i == 0:
            group["weight_decay"] = t.weight_decay
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
    return changed
