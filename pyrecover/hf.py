"""pyrecover's GPT as a Hugging Face GPT-2: the config and the weights, named as
`transformers.GPT2LMHeadModel` names them, with every difference between the two models mapped
on purpose (read against transformers' modeling_gpt2):

- activation: the GPT's MLP uses exact GELU (`F.gelu`, erf); GPT-2's default is the tanh
  approximation (`gelu_new`), so the config says `activation_function: gelu`.
- absent biases: with `model.bias: false` the GPT's linears and LayerNorms have none, and
  GPT-2's always have one; zeros there compute the same thing.
- linears: GPT-2's `Conv1D` stores a weight as (in, out), `nn.Linear` as (out, in): transposed.
- the head is tied to the token embedding in both; it is written once, as the embedding, and
  `tie_word_embeddings: true` ties it again on load. A head that is not the embedding is refused.
- LayerNorm eps 1e-5 (`nn.LayerNorm`'s default), attention scaled by 1/sqrt(head_dim) only,
  learned positions up to `block_size`, one dropout probability for all three GPT-2 dropouts.

Pure: no file I/O, no transformers import. A model it cannot express raises NotExpressible.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

# The model options this mapping knows, with what each becomes. A checkpoint with another
# option (a newer pyrecover's model) is refused rather than exported without it.
OPTIONS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias")
LAYER_NORM_EPS = 1e-5  # nn.LayerNorm's default, which model.py keeps


class NotExpressible(ValueError):
    """The model has something a Hugging Face GPT-2 cannot hold; the message says what."""


def gpt2_config(model: Mapping[str, Any], dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """gpt2_config is the `config.json` of a GPT2LMHeadModel equal to the GPT of `model` (the
    `model:` section of a run's config)."""
    unknown = sorted(set(model) - set(OPTIONS))
    if unknown:
        key = unknown[0]
        raise NotExpressible(f"model.{key}={model[key]!r} has no Hugging Face GPT-2 equivalent "
                             "(this version maps only model." + ", model.".join(OPTIONS) + ")")
    missing = [k for k in OPTIONS if k not in model]
    if missing:
        raise NotExpressible(f"the checkpoint's model config lacks model.{missing[0]}")
    if model["n_embd"] % model["n_head"]:
        raise NotExpressible(f"model.n_embd={model['n_embd']} is not a multiple of "
                             f"model.n_head={model['n_head']}, as GPT-2's attention needs")
    p = float(model["dropout"])
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": int(model["vocab_size"]),
        "n_positions": int(model["block_size"]),
        "n_embd": int(model["n_embd"]),
        "n_layer": int(model["n_layer"]),
        "n_head": int(model["n_head"]),
        "n_inner": 4 * int(model["n_embd"]),
        "activation_function": "gelu",
        "resid_pdrop": p,
        "embd_pdrop": p,
        "attn_pdrop": p,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "initializer_range": 0.02,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        # Tokens are pyrecover's (bytes and 256 = end of document, or a pre-tokenized
        # corpus's): GPT-2's 50256 would name a token this vocabulary may not have.
        "bos_token_id": None,
        "eos_token_id": None,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def _layout(model: Mapping[str, Any]) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """_layout maps each GPT-2 weight name to (the GPT's name, how to carry it, its shape):
    "copy", "t" (transpose a Linear into a Conv1D) or "zeros" (a bias the GPT does not have)."""
    c, v = int(model["n_embd"]), int(model["vocab_size"])
    bias = bool(model["bias"])
    out = {"transformer.wte.weight": ("wte.weight", "copy", (v, c)),
           "transformer.wpe.weight": ("wpe.weight", "copy", (int(model["block_size"]), c))}

    def norm(ours: str, theirs: str) -> None:
        out[f"{theirs}.weight"] = (f"{ours}.weight", "copy", (c,))
        out[f"{theirs}.bias"] = (f"{ours}.bias", "copy" if bias else "zeros", (c,))

    def linear(ours: str, theirs: str, n_in: int, n_out: int) -> None:
        out[f"{theirs}.weight"] = (f"{ours}.weight", "t", (n_in, n_out))
        out[f"{theirs}.bias"] = (f"{ours}.bias", "copy" if bias else "zeros", (n_out,))

    for i in range(int(model["n_layer"])):
        ours, theirs = f"blocks.{i}", f"transformer.h.{i}"
        norm(f"{ours}.ln1", f"{theirs}.ln_1")
        linear(f"{ours}.attn.qkv", f"{theirs}.attn.c_attn", c, 3 * c)
        linear(f"{ours}.attn.proj", f"{theirs}.attn.c_proj", c, c)
        norm(f"{ours}.ln2", f"{theirs}.ln_2")
        linear(f"{ours}.mlp.fc", f"{theirs}.mlp.c_fc", c, 4 * c)
        linear(f"{ours}.mlp.proj", f"{theirs}.mlp.c_proj", 4 * c, c)
    norm("ln_f", "transformer.ln_f")
    return out


def gpt2_state(state: Mapping[str, torch.Tensor], model: Mapping[str, Any]
               ) -> dict[str, torch.Tensor]:
    """gpt2_state renames and reshapes the GPT's `state` (its state_dict) into the weights of a
    GPT2LMHeadModel with gpt2_config(model); every tensor contiguous and owning its bytes.

    Refuses a state that is not exactly that GPT's: a key too many or too few, a shape that
    differs, or a head that is not the token embedding.
    """
    gpt2_config(model)  # the options first: their error names the cause
    layout = _layout(model)
    expected = {ours for ours, how, _ in layout.values() if how != "zeros"} | {"head.weight"}
    extra, absent = sorted(set(state) - expected), sorted(expected - set(state))
    if extra:
        raise NotExpressible(f"weight {extra[0]!r} has no place in a GPT-2 "
                             f"({len(extra)} such weight(s))")
    if absent:
        raise NotExpressible(f"the checkpoint's model lacks weight {absent[0]!r}")
    if not torch.equal(state["head.weight"], state["wte.weight"]):
        raise NotExpressible("head.weight differs from wte.weight: GPT-2's head is the token "
                             "embedding, as pyrecover's GPT ties them")
    dtype = state["wte.weight"].dtype
    out = {}
    for theirs, (ours, how, shape) in layout.items():
        if how == "zeros":
            out[theirs] = torch.zeros(shape, dtype=dtype)
            continue
        want = shape[::-1] if how == "t" else shape
        if tuple(state[ours].shape) != want:
            raise NotExpressible(f"weight {ours!r} has shape {tuple(state[ours].shape)} where "
                                 f"the checkpoint's model config gives {want}")
        tensor = state[ours].detach().to("cpu")
        out[theirs] = (tensor.t() if how == "t" else tensor).contiguous().clone()
    return out
