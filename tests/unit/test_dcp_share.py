"""Which rank writes which tensor of a DDP state (checkpoint/share.py): every tensor by exactly
one rank, balanced by bytes, decided the same on every rank."""

from __future__ import annotations

import random

import torch

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import share


def _random_state(rng: random.Random) -> dict:
    state: dict = {"model": {}, "optim": {"state": {}, "param_groups": [{"lr": 0.1}]}}
    for i in range(rng.randrange(1, 30)):
        t = torch.zeros(rng.choice([1, 3, 64, 1000, 5000]), dtype=rng.choice(
            [torch.float32, torch.bfloat16, torch.int64]))
        state["model"][f"layer{i}.w"] = t
        state["optim"]["state"][f"layer{i}.w"] = {"exp_avg": torch.zeros_like(t),
                                                  "step": torch.tensor(1.0)}
    state["model"]["tied"] = state["model"]["layer0.w"]  # tied weights: one tensor, two keys
    return state


def _tensor_paths(state, path=()):
    if isinstance(state, dict):
        for k, v in state.items():
            yield from _tensor_paths(v, (*path, k))
    elif isinstance(state, torch.Tensor):
        yield path, state


def test_every_tensor_is_written_by_exactly_one_rank_and_the_shares_balance():
    rng = random.Random(7)
    for _ in range(200):
        state, world = _random_state(rng), rng.randrange(2, 9)
        shares = [dict(_tensor_paths(share.own_share(state, r, world))) for r in range(world)]
        every = dict(_tensor_paths(state))
        seen = [p for s in shares for p in s]
        assert sorted(seen, key=repr) == sorted(every, key=repr)  # each once, none lost
        owner = share.owners(state, world)
        assert owner[("model", "tied")] == owner[("model", "layer0.w")]
        assert all(owner[p] == 0 for p in [("optim", "param_groups")])  # non-tensors: rank 0
        # Balance: no rank carries more than the lightest one plus the largest tensor.
        loads = [sum(t.numel() * t.element_size() for p, t in s.items() if p != ("model", "tied"))
                 for s in shares]
        largest = max(t.numel() * t.element_size() for t in every.values())
        assert max(loads) - min(loads) <= largest


def test_the_shares_are_decided_alike_on_every_rank_whatever_the_memory_addresses():
    a, b = build_state(300_000, seed=0).parts, build_state(300_000, seed=1).parts
    sa = {"model": a.model.state_dict()}
    sb = {"model": b.model.state_dict()}
    assert share.owners(sa, 4) == share.owners(sb, 4)


def test_one_rank_keeps_the_whole_state_and_a_plain_state_is_replicated():
    state = _random_state(random.Random(1))
    assert share.own_share(state, 0, 1) is state
    assert share.replicated(state)
