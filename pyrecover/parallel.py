"""How the ranks share the model: DDP (every rank holds all of it) or FSDP2 (each holds a shard).

`train.parallel: fsdp` shards the parameters, gradients and optimizer state over the ranks
with `torch.distributed.fsdp.fully_shard`: one unit per transformer block (its parameters are
gathered just before the block runs and freed after), then the root (embeddings, final norm).
On CUDA with bf16 precision the blocks compute in bf16 from fp32 master weights and reduce
gradients in fp32 (`MixedPrecisionPolicy`), so no autocast is needed around the forward.

The loop talks to either kind through `grad_sync` (no gradient reduction on accumulation
micro-steps) and `clip_grad_norm` (the global norm over sharded gradients), so it never
branches on the kind itself.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

import torch


def is_sharded(model: torch.nn.Module) -> bool:
    """is_sharded tells whether `model` is an FSDP2 module (its parameters are DTensor shards).
    Only a process that imported torch.distributed.fsdp (fully_shard's package) can have one,
    and importing it just to ask cost a vanilla restore 0.35-0.45 s on the 2-core VM."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(model, fsdp.FSDPModule)


def mixed_precision(device: torch.device, precision: str) -> bool:
    """mixed_precision tells whether FSDP runs bf16 compute over fp32 master weights: on CUDA,
    where `train.precision` resolves to bf16 (on a CPU bf16 stays autocast, as with DDP: gloo
    all-gathers in fp32)."""
    return device.type == "cuda" and precision in ("auto", "bf16")


def shard(model: torch.nn.Module, device: torch.device, precision: str,
          compile_blocks: bool = False) -> torch.nn.Module:
    """shard applies FSDP2 to `model` in place (one unit per block, then the root) and returns
    it. Call it before building the optimizer: the optimizer must hold the sharded parameters.
    With `compile_blocks` each block is compiled before it is sharded (what torchtitan does:
    the graph never sees FSDP's hooks)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if mixed_precision(device, precision):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = model.blocks  # type: ignore[attr-defined]
    for i, block in enumerate(blocks):
        if compile_blocks:
            block.compile()
        # The last block's parameters are needed again at once by the backward: keep them.
        fully_shard(block, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mp_policy=policy)
    return model


def replicate(model: torch.nn.Module, device: torch.device, world_size: int,
              sample: Callable[[], tuple[torch.Tensor, torch.Tensor]],
              autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
              ) -> torch.nn.Module:
    """replicate wraps `model` in DDP, ready for the first step to be the same as any other.

    Every rank built the same weights from the same seed or restored the same checkpoint, so
    DDP is told not to broadcast rank 0's (`init_sync=False` where torch has it: the whole
    model once more over the network, 0.3 s of a restart for a 1 GB state on 2 CPU ranks).

    DDP lays out its gradient buckets one way on the first iteration after it is built and
    rebuilds them after that; with 3+ ranks the ring all-reduce then sums in another order.
    A run that resumed would otherwise take its first step in the first layout while the
    uninterrupted run took that step in the second, and differ in the last bits. So with 3+
    ranks one throw-away forward/backward on `sample()` settles the layout first (weights,
    optimizer, RNG and data position untouched; under the steps' `autocast`, so a compiled
    model compiles once, for the graph the steps use). With 2 ranks every element is one sum
    of two numbers, the same in either order, and that step would only cost time.

    The gradients are views into DDP's buckets (`gradient_as_bucket_view`), not a second copy
    the buckets are filled from: one model's worth of memory less on every rank, one copy
    less per step, and memory a restart's first step does not have to fault in. With a 1 GB
    state on 2 CPU ranks that took the first resumed step from 2.9-3.3 s to 1.7-2.1 s (`bench
    restart --local --state-gb 1`, 2-core VM, where fresh pages cost ~1.9 s per GiB).
    """
    import inspect

    from torch.nn.parallel import DistributedDataParallel as DDP

    # init_sync came late in torch's 2.x (about 2.6/2.7); a torch without it broadcasts.
    no_sync = {"init_sync": False} if "init_sync" in inspect.signature(DDP).parameters else {}
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                gradient_as_bucket_view=True, **no_sync)
    if world_size > 2:
        x, y = sample()
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with autocast():
                _, loss = model(x.to(device), y.to(device))
            loss.backward()
        model.zero_grad(set_to_none=True)
    return model


@contextlib.contextmanager
def grad_sync(model: torch.nn.Module, sync: bool) -> Iterator[None]:
    """grad_sync runs one micro-step's backward with (sync) or without the cross-rank gradient
    reduction: DDP's `no_sync`; FSDP keeps unsharded gradients until the last micro-step, then
    reduce-scatters their sum once."""
    if is_sharded(model):
        model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        yield
    elif not sync and hasattr(model, "no_sync"):
        with model.no_sync():  # type: ignore[operator]
            yield
    else:
        yield


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """clip_grad_norm scales the gradients so their global 2-norm is at most `max_norm` and
    returns that norm (before clipping) as a plain tensor, the same on every rank.

    With FSDP each rank holds a shard of every gradient: the norm of the shards is a partial
    result that `full_tensor()` sums over the ranks before any gradient is scaled."""
    if not is_sharded(model):
        return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0, foreach=True)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
    return total


def state_bytes(model: torch.nn.Module, optimizer_copies: int = 2) -> int:
    """state_bytes is the size of the whole (unsharded) model and AdamW state in bytes: what
    gathering it onto one rank costs."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size() * (1 + optimizer_copies)
    return total


def check_gather(model: torch.nn.Module, mode: str, limit_gb: float) -> None:
    """check_gather refuses, for a sharded model whose state is larger than
    `checkpoint.gather_max_gb`, the modes that put it together whole: vanilla gathers it onto
    rank 0 (the slow path), memory's restore onto every rank (an 8-GPU node would need 8
    times the state in host memory)."""
    where = {"vanilla": "onto rank 0", "memory": "onto every rank when it restores"}
    if mode not in where or not is_sharded(model):
        return
    need = state_bytes(model)
    if need > limit_gb * 1e9:
        from pyrecover.config import ConfigError

        raise ConfigError(
            f"checkpoint.mode={mode} would gather {need / 1e9:.3g} GB of model and optimizer "
            f"state {where[mode]} (checkpoint.gather_max_gb={limit_gb:g}); use "
            f"checkpoint.mode=dcp, where each rank writes its own shards")
