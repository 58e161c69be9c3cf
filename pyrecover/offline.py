"""The live objects `pyrecover ckpt` reads a checkpoint into, outside training: built here, on
the CPU, from the config the checkpoint holds, and passed to checkpoint/, which builds no model
of its own (checkpoint/mode.py: `ModelBuilder`, `Offline`)."""

from __future__ import annotations

from typing import Any

import torch

from pyrecover import config as config_mod
from pyrecover.checkpoint.mode import Parts
from pyrecover.model import GPTConfig, empty_gpt
from pyrecover.optim import build_optimizer, build_scheduler


def build_model(model: dict[str, Any]) -> torch.nn.Module:
    """build_model is a GPT of a config's model section, its weights allocated on the CPU but
    not initialized (model.empty_gpt): every read loads all of them, as a resume does."""
    return empty_gpt(GPTConfig(**model), "cpu")


def build_parts(cfg: dict[str, Any]) -> Parts:
    """build_parts is the model, optimizer and scheduler a run of resolved config `cfg` trains,
    for a whole state to be loaded into."""
    full = config_mod.from_dict(cfg)
    model = build_model(cfg["model"])
    optimizer = build_optimizer(model, full, torch.device("cpu"))
    return Parts(model=model, optimizer=optimizer, scheduler=build_scheduler(optimizer, full),
                 config=cfg, train_state=dict)
