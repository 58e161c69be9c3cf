"""The synthetic state a benchmark saves and loads: a real `GPT` and its filled AdamW state."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BYTES_PER_PARAM = 12  # fp32 weights + AdamW's exp_avg and exp_avg_sq


def gpt_shape(target_bytes: int) -> dict[str, int]:
    """gpt_shape picks GPT dimensions whose weights + AdamW state come near `target_bytes`.

    Width grows with depth as in published GPTs (about 64 channels per layer); heads are 64
    wide. Parameters are 12 * layers * width^2 plus the embeddings.
    """
    params = max(1.0, target_bytes / BYTES_PER_PARAM)
    layers = max(1, round((params / (12 * 64 * 64)) ** (1 / 3)))
    width = max(64, round(math.sqrt(params / (12 * layers)) / 64) * 64)
    layers = max(1, round((params - 1344 * width) / (12 * width * width)))
    return {"vocab_size": 320, "block_size": 1024, "n_layer": layers,
            "n_head": width // 64, "n_embd": width}


@dataclass
class State:
    """A live model + AdamW (with its state filled in) as pyrecover's checkpoint code sees it."""

    parts: Any  # pyrecover.checkpoint.mode.Parts
    shape: dict[str, int]

    def tensors(self) -> list[Any]:
        """tensors lists every distinct tensor of the model and the optimizer state."""
        seen, out = set(), []
        items = list(self.parts.model.state_dict().values())
        for per_param in self.parts.optimizer.state.values():
            items += [v for v in per_param.values() if hasattr(v, "data_ptr")]
        for t in items:
            key = (t.data_ptr(), t.numel())
            if key not in seen and t.numel() > 1:
                seen.add(key)
                out.append(t)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def build_state(target_bytes: int, seed: int = 0) -> State:
    """build_state makes a GPT + AdamW of about `target_bytes` with every optimizer slot filled."""
    import torch

    from pyrecover.checkpoint.mode import Parts
    from pyrecover.model import GPT, GPTConfig

    shape = gpt_shape(target_bytes)
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**shape))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()  # fills exp_avg and exp_avg_sq, as after the first real step
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    train = {"step": 0, "tokens_seen": 0, "data_position": 0, "bad_steps": 0}
    parts = Parts(model=model, optimizer=optimizer, scheduler=scheduler,
                  config={"bench": shape}, train_state=lambda: dict(train))
    return State(parts, shape)


def own(state: State) -> None:
    """own copies optimizer tensors that still map a checkpoint file into private memory
    (`vanilla.own_cpu_state`, which a vanilla restore already does; a plain mmap load does
    not): mapped pages cannot be evicted, so the next cold read of that file would not be
    cold. Not part of any measured time."""
    from pyrecover.checkpoint.vanilla import own_cpu_state

    own_cpu_state(state.parts.optimizer)


def touch(state: State) -> None:
    """touch reads one element per 4 KiB page of every tensor (faults in a lazy mmap load)."""
    for t in state.tensors():
        stride = max(1, 4096 // t.element_size())
        t.reshape(-1)[::stride].sum()

