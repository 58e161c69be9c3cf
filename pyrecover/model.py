"""A GPT-style decoder: pre-norm blocks, causal scaled-dot-product attention, tied embeddings."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# The model's sizes are the `model:` section of the experiment config, validated there.
from pyrecover.config import ModelConfig as GPTConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm: the residual stream itself is never normalized, which keeps deep stacks
        # trainable without warmup tricks.
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Tied embeddings: the output projection reuses the input table (fewer parameters,
        # and the two are better trained together).
        self.tie_weights()
        self.apply(self._init)
        # Scale the residual projections by depth so the stream's variance does not grow with it.
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def tie_weights(self) -> None:
        self.head.weight = self.wte.weight

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens exceeds block_size {self.cfg.block_size}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class _SkipInit(torch.overrides.TorchFunctionMode):
    """_SkipInit makes torch.nn.init's functions return their tensor as it is: a model built on
    the meta device has shapes, no values. On meta, `normal_` runs torch's Python reference
    implementation, whose wrapper imports torch._dynamo at its first call (1.0-1.1 s of CPU
    on a 2-core VM, in every start of a resume)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__module__", None) == "torch.nn.init":
            return kwargs["tensor"] if "tensor" in kwargs else args[0]
        return func(*args, **kwargs)


def empty_gpt(cfg: GPTConfig, device: torch.device | str) -> GPT:
    """empty_gpt is a GPT with its weights allocated on `device` but not initialized, for a
    resume, which overwrites every one of them: initializing them first cost 0.8 s of CPU for
    80M parameters (measured on the 2-core VM), more for larger models, and on a GPU a copy of
    them all. Give it weights before use (`load_state_dict`; `initialize` where nothing was
    restored)."""
    with torch.device("meta"), _SkipInit():
        model = GPT(cfg)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives each module a tensor of its own
    return model


def initialize(model: GPT, seed: int) -> None:
    """initialize gives `model` the weights `torch.manual_seed(seed); GPT(cfg)` has, bit for
    bit (built on the CPU, as a fresh start always was, and copied in)."""
    torch.manual_seed(seed)
    model.load_state_dict(GPT(model.cfg).state_dict())
