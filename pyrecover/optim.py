"""The optimizer and learning-rate schedule a run uses, built from its config.

One place, so the trainer and the checkpoint tools (which rebuild a run's optimizer to
convert a checkpoint) build exactly the same thing.
"""

from __future__ import annotations

import math

import torch

from pyrecover.config import Config


def build_optimizer(model: torch.nn.Module, cfg: Config,
                    device: torch.device) -> torch.optim.Optimizer:
    """build_optimizer is AdamW with weight decay on matrices only (not norms or biases)."""
    t = cfg.train
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2),
                             fused=device.type == "cuda" or None)


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
