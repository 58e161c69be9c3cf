"""DDP's gradients, as the trainer wraps the model (parallel.replicate): averaged over the ranks
and over the micro-steps of gradient accumulation, cleared by `zero_grad(set_to_none=True)`
between steps, and held once, in DDP's buckets (`gradient_as_bucket_view`), not in a second
copy: a model's worth of memory per rank, and pages a restart's first step would fault in."""

from __future__ import annotations

import pytest
import torch
from helpers import run_ranks

from pyrecover import parallel
from pyrecover.config import ModelConfig
from pyrecover.model import empty_gpt, initialize

pytestmark = pytest.mark.multiproc

CFG = ModelConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32, dropout=0.0,
                  bias=False)
MICRO = 2  # micro-steps per step
STEPS = 2


def _batch(step: int, rank: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _reference(step: int) -> dict[str, torch.Tensor]:
    """The mean gradient over both ranks' micro-batches, in one process without DDP."""
    model = empty_gpt(CFG, "cpu")
    initialize(model, 7)
    for rank in range(2):
        for micro in range(MICRO):
            _, loss = model(*_batch(step, rank, micro))
            (loss / (MICRO * 2)).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _rank(rank: int) -> None:
    model = empty_gpt(CFG, "cpu")
    initialize(model, 7)
    ddp = parallel.replicate(model, torch.device("cpu"), 2, lambda: _batch(0, rank, 0))
    for step in range(STEPS):  # the same weights every step: no update, only the gradients
        for micro in range(MICRO):
            with parallel.grad_sync(ddp, micro == MICRO - 1):
                _, loss = ddp(*_batch(step, rank, micro))
                (loss / MICRO).backward()
        want = _reference(step)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7,
                                       msg=f"{name}, step {step}")
        grads = [p.grad for p in model.parameters()]
        storages = {g.untyped_storage().data_ptr() for g in grads}
        assert len(storages) < len(grads) / 2, "each gradient has a storage of its own"
        ddp.zero_grad(set_to_none=True)
        assert all(p.grad is None for p in model.parameters())


def test_ddp_gradients_are_the_mean_over_ranks_and_micro_steps_and_live_in_its_buckets():
    run_ranks(_rank)
