"""A resume builds the model without initializing its weights (model.empty_gpt) and a fresh
start initializes them afterwards (model.initialize): the weights a run starts from must be
the very ones `torch.manual_seed(seed); GPT(cfg)` gives, and tied weights must stay tied."""

from __future__ import annotations

import pytest
import torch

from pyrecover.model import GPT, GPTConfig, empty_gpt, initialize

SHAPES = [GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=64, vocab_size=257),
          GPTConfig(n_layer=3, n_head=4, n_embd=32, block_size=16, vocab_size=300, bias=True)]


@pytest.mark.parametrize("cfg", SHAPES)
@pytest.mark.parametrize("seed", [0, 1337])
def test_an_empty_model_initialized_later_equals_one_built_the_usual_way(cfg, seed):
    torch.manual_seed(seed)
    usual = GPT(cfg)
    torch.manual_seed(seed + 1)  # whatever ran in between does not matter
    model = empty_gpt(cfg, "cpu")
    assert model.head.weight is model.wte.weight  # tied, as the usual model is
    assert model.num_params() == usual.num_params()
    assert all(p.device.type == "cpu" for p in model.parameters())
    initialize(model, seed)
    expected = usual.state_dict()
    got = model.state_dict()
    assert list(got) == list(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected), "weights differ"
    assert model.head.weight is model.wte.weight  # a load keeps the tie


def test_a_restore_into_an_empty_model_reaches_every_weight():
    # What a resume relies on: load_state_dict fills every parameter and buffer it has, so
    # nothing of the uninitialized memory survives.
    cfg = SHAPES[1]
    torch.manual_seed(3)
    source = GPT(cfg)
    model = empty_gpt(cfg, "cpu")
    for p in model.parameters():
        p.data.fill_(float("nan"))
    model.load_state_dict(source.state_dict())
    assert not any(torch.isnan(t).any() for t in model.state_dict().values())
    x = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
    assert torch.equal(model(x)[0], source(x)[0])
