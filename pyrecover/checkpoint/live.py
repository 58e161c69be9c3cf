"""The live state's tensors as `get_state_dict` names them, found once and reused.

`torch.distributed.checkpoint.state_dict.get_state_dict` names every parameter by its fully
qualified name, and walks the model to do it: 13-25 ms for the 15-layer GPT of a 1.5 GB
state on the 2-core VM, in the loop's time at every save or snapshot, where the copy it
starts takes about 0.1 s. Its tensors are the live ones, which the optimizer updates in
place, so they stay right while `identity` is unchanged; the optimizer's hyper-parameters (the
LR moves every step) are read again each time (`param_groups`).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """local is a tensor's bytes on this rank: an FSDP shard's (DTensor) own rows, else itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def param_groups(optimizer: torch.optim.Optimizer, fqns: list[list[str]]) -> list[dict]:
    """param_groups is `get_state_dict`'s `param_groups`: the hyper-parameters as they are
    now (the LR moves every step), parameters named by their fully qualified names."""
    return [{**{k: v for k, v in group.items() if k != "params"}, "params": names}
            for group, names in zip(optimizer.param_groups, fqns, strict=True)]


def identity(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
             buffers: bool = True) -> tuple[int, ...]:
    """identity names the storage of the live tensors a save or snapshot copies, in order: the
    optimizer's parameters and state, and the model's buffers when `buffers`.

    While it is unchanged, the tensors found by `get_state_dict` last time are still the live
    ones (parameters and optimizer state are updated in place); a restore, a re-created
    optimizer state or the first step's lazily created AdamW state changes it. It assumes a
    parameter the optimizer does not hold (a frozen one) is not replaced by another tensor
    during the run, and that a model without buffers at the first snapshot gets none later.
    """
    # The optimizer's flat list of parameters stands for the model's (walking the modules cost
    # 0.1 ms per snapshot of a tiny model); a parameter it does not hold is not trained.
    ptrs = [local(p).data_ptr() for group in optimizer.param_groups for p in group["params"]]
    ptrs += [local(t).data_ptr() for t in model.buffers()] if buffers else []
    for per_param in optimizer.state.values():
        ptrs += [local(v).data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor)]
    return tuple(ptrs)


class LiveStateDict:
    """LiveStateDict is `get_state_dict(model, optimizer)`, asked again only when `identity`
    changed; the hyper-parameters are always today's. A model's non-tensor extra state
    (`get_extra_state`) would be last asked's: pyrecover's GPT has none."""

    def __init__(self) -> None:
        self._key: tuple[int, ...] | None = None
        self._found: tuple[dict[str, Any], dict[str, Any], list[list[str]]] | None = None

    def get(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
            ) -> tuple[dict[str, Any], dict[str, Any]]:
        key = identity(model, optimizer)
        if self._found is None or key != self._key:
            model_sd, optim_sd = get_state_dict(model, optimizer)
            fqns = [list(g["params"]) for g in optim_sd["param_groups"]]
            self._key, self._found = key, (model_sd, optim_sd, fqns)
        model_sd, optim_sd, fqns = self._found
        # New top-level dicts each time: a caller may add to them or drop keys.
        return copy.copy(model_sd), {**optim_sd, "param_groups": param_groups(optimizer, fqns)}
