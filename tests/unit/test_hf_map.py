"""The GPT -> Hugging Face GPT-2 mapping (pyrecover/hf.py) on models built in memory: every
model option's values give a GPT2LMHeadModel that loads the weights strictly and computes the
GPT's logits; what GPT-2 cannot hold is refused with the reason."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pyrecover import hf
from pyrecover.model import GPT, GPTConfig

transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")

SMALL = {"vocab_size": 257, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32,
         "dropout": 0.0, "bias": False}


def trained_like(cfg: GPTConfig, seed: int) -> GPT:
    """trained_like is a GPT whose every weight (the LayerNorms' and the biases' too) is far
    from its initial value, so a weight mapped to the wrong place cannot go unnoticed."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def as_gpt2(model: GPT, attn: str) -> transformers.GPT2LMHeadModel:
    model_cfg = dataclasses.asdict(model.cfg)
    config = transformers.GPT2Config(**hf.gpt2_config(model_cfg))
    config._attn_implementation = attn
    theirs = transformers.GPT2LMHeadModel(config).eval()
    result = theirs.load_state_dict(hf.gpt2_state(model.state_dict(), model_cfg), strict=False)
    # The head is tied, so it is the one weight the state leaves to the tie.
    assert not result.unexpected_keys and set(result.missing_keys) <= {"lm_head.weight"}
    assert theirs.lm_head.weight.data_ptr() == theirs.transformer.wte.weight.data_ptr()
    return theirs


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("change", [
    {}, {"bias": True}, {"n_head": 1}, {"n_head": 8, "n_embd": 64}, {"n_layer": 3},
    {"vocab_size": 320, "block_size": 24}, {"dropout": 0.2, "bias": True}])
def test_every_model_option_gives_the_same_logits_in_transformers(change, attn):
    cfg = GPTConfig(**{**SMALL, **change})
    ours = trained_like(cfg, seed=len(change))
    theirs = as_gpt2(ours, attn)
    tokens = torch.randint(0, cfg.vocab_size, (3, cfg.block_size),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, _ = ours(tokens)
        got = theirs(tokens).logits
        short = theirs(tokens[:, :5]).logits
    torch.testing.assert_close(got, want)  # fp32 tolerances
    torch.testing.assert_close(short, want[:, :5])  # causal: a prefix sees only itself


def test_the_config_maps_the_differences_from_gpt2s_defaults_explicitly():
    config = hf.gpt2_config({**SMALL, "dropout": 0.1})
    defaults = transformers.GPT2Config()
    # exact GELU, not GPT-2's tanh approximation; no end-of-text id this vocabulary lacks
    assert config["activation_function"] == "gelu" != defaults.activation_function
    assert config["bos_token_id"] is None and config["eos_token_id"] is None
    assert (config["n_positions"], config["tie_word_embeddings"]) == (16, True)
    assert config["resid_pdrop"] == config["embd_pdrop"] == config["attn_pdrop"] == 0.1
    assert config["layer_norm_epsilon"] == torch.nn.LayerNorm(4).eps


def state_of(**change) -> dict[str, torch.Tensor]:
    return GPT(GPTConfig(**{**SMALL, **change})).state_dict()


def untied(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    state = dict(state)
    state["head.weight"] = state["wte.weight"] + 1
    return state


@pytest.mark.parametrize(("model", "state", "says"), [
    ({**SMALL, "norm": "rms"}, state_of(), "model.norm='rms' has no Hugging Face GPT-2"),
    ({k: v for k, v in SMALL.items() if k != "bias"}, state_of(), "lacks model.bias"),
    (SMALL, untied(state_of()), "head.weight differs from wte.weight"),
    (SMALL, {**state_of(), "blocks.0.attn.rotary.freq": torch.ones(4)},
     "'blocks.0.attn.rotary.freq' has no place"),
    (SMALL, state_of(bias=True), "'blocks.0.attn.proj.bias' has no place"),
    ({**SMALL, "bias": True}, state_of(), "lacks weight 'blocks.0.attn.proj.bias'"),
    ({**SMALL, "n_layer": 1}, state_of(), "'blocks.1.attn.proj.weight' has no place"),
    ({**SMALL, "block_size": 32}, state_of(), "'wpe.weight' has shape (16, 32) where"),
], ids=["unknown-option", "missing-option", "untied-head", "extra-weight", "bias-not-in-config",
        "bias-missing", "layers-disagree", "shape-disagrees"])
def test_a_model_gpt2_cannot_hold_is_refused_naming_why(model, state, says):
    with pytest.raises(hf.NotExpressible, match=None) as err:
        hf.gpt2_state(state, model)
    assert says in str(err.value) and "\n" not in str(err.value)
