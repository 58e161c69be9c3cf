"""Random generator states: captured per rank at a save, put back at a resume."""

from __future__ import annotations

import random
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """capture returns this process's python, torch CPU and CUDA generator states."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_rank(seed: int, rank: int) -> None:
    """seed_rank gives each rank its own dropout stream after the shared weight init."""
    random.seed(seed + rank)
    torch.manual_seed(seed + 7919 * (rank + 1))


def _as_tuple(value: Any) -> Any:
    # weights_only loading returns the python state's tuples as they were saved, but a JSON
    # round trip would give lists; random.setstate needs tuples.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value
