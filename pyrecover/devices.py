"""What a run trains on: the device kind a config asks for, its autocast and its name in logs.

Shared by the trainer and `bench train`'s plain loop, so both train on the same device in
the same precision.
"""

from __future__ import annotations

import contextlib

import torch

from pyrecover.config import Config, ConfigError


def device_kind(cfg: Config) -> str:
    """device_kind is "cuda" or "cpu": train.device, with auto taking a GPU where one is."""
    if cfg.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device='cuda' but no CUDA device is available; use auto or cpu")
    return cfg.train.device


def autocast_for(cfg: Config, device: torch.device):
    """autocast_for makes the context each forward runs in: bf16 autocast for train.precision
    bf16 (auto: on CUDA), else none."""
    precision = cfg.train.precision
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def kind_name(device: torch.device) -> str:
    """kind_name names the device in the start's log line."""
    if device.type == "cuda":
        return f"CUDA {torch.cuda.get_device_name(device)}"
    n = torch.get_num_threads()
    return f"CPU ({n} thread{'s' if n != 1 else ''})"

