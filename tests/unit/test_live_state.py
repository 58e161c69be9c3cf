"""The live state's names, found once: what a save or snapshot reuses must be what
`get_state_dict` would say now, step after step, and a restore's new tensors must be seen."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from pyrecover.checkpoint.live import LiveStateDict, identity
from pyrecover.model import GPT, GPTConfig


def same(a: Any, b: Any, where: str = "") -> None:
    """same asserts two state dicts hold the same structure, values and tensor storage."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}/{i}")
    elif isinstance(a, torch.Tensor):
        assert a.data_ptr() == b.data_ptr() and torch.equal(a, b), where
    else:
        assert a == b, where


def train_step(model: GPT, optimizer, scheduler) -> None:
    x = torch.randint(0, 64, (2, 8))
    _, loss = model(x, x)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()


def test_the_reused_state_dict_is_what_get_state_dict_says_at_every_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    live = LiveStateDict()
    live.get(model, optimizer)  # before the first step: no optimizer state yet
    for _ in range(4):
        train_step(model, optimizer, scheduler)
        got = live.get(model, optimizer)
        same(got, get_state_dict(model, optimizer))
    assert got[1]["param_groups"][0]["lr"] == optimizer.param_groups[0]["lr"] < 1e-3


def test_a_restore_s_new_optimizer_tensors_are_found_again():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    train_step(model, optimizer, scheduler)
    live = LiveStateDict()
    live.get(model, optimizer)
    before = identity(model, optimizer)
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # a restore's new tensors
    assert identity(model, optimizer) != before
    same(live.get(model, optimizer), get_state_dict(model, optimizer))
