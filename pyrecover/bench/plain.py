"""The plain training loop `bench train --plain` holds pyrecover's trainer against.

What a user would write by hand for the same run: the same `GPT`, the same optimizer (fused
AdamW on CUDA), bf16 autocast and `torch.compile` where the trainer would use them, the same
windows of the same corpus, gradient accumulation and clipping; and nothing else: no
checkpoint manager, stop agreement, metrics file, progress or NaN guard. It reads the loss
once, at the end, and the device is synchronized where the clock is read, so the figure is
what the GPU did.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pyrecover import compiling
from pyrecover import config as config_mod
from pyrecover.config import Config


def plain_tokens_per_s(cfg: Config, steps: int, warmup: int) -> dict[str, Any]:
    """plain_tokens_per_s trains `warmup + steps` steps the plain way; tokens/s of the last
    `steps`, and whether it compiled."""
    from pyrecover import devices
    from pyrecover.data import Batches, load_tokens
    from pyrecover.model import GPT, GPTConfig
    from pyrecover.optim import build_optimizer, build_scheduler

    t = cfg.train
    kind = devices.device_kind(cfg)
    device = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    if kind == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(t.seed)
    model = GPT(GPTConfig(**config_mod.to_dict(cfg)["model"])).to(device)
    compiled = compiling.compile_enabled(cfg, device)
    if compiled:
        model.compile()
    optimizer = build_optimizer(model, cfg, device)
    scheduler = build_scheduler(optimizer, cfg)
    autocast = devices.autocast_for(cfg, device)
    batches = Batches(load_tokens(cfg.data.path, cfg.data.column), cfg.model.block_size, t.seed)
    model.train()

    def step() -> torch.Tensor:
        micro = batches.next_global(t.global_batch_size, 0, 1, t.micro_batch_size)
        total = torch.zeros((), device=device)
        for x, y in micro:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with autocast():
                _, loss = model(x, y)
            (loss / len(micro)).backward()
            total += loss.detach().float()
        if t.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        return total

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(warmup):
        step()
    sync()
    started = time.perf_counter()
    for _ in range(steps):
        last = step()
    final_loss = float(last)  # reads the device: the clock stops after the last step
    sync()
    seconds = time.perf_counter() - started
    tokens = steps * t.global_batch_size * cfg.model.block_size
    return {"tokens_per_s": tokens / seconds, "seconds": seconds, "compiled": compiled,
            "final_loss": final_loss}
