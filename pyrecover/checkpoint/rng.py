"""Random generator states: captured per rank at a save, put back at a resume."""

from __future__ import annotations

import random
import struct
from array import array
from typing import Any

import torch


def capture() -> dict[str, Any]:
    """capture returns this process's python, torch CPU and CUDA generator states: the CUDA
    one of its own device only (a list of one), the device every rank uses alone.

    Only a process that uses CUDA has a CUDA state: a CPU run on a GPU node (train.device=cpu,
    gpu-check's CPU benches) asked for one at every save, and so started CUDA on GPU 0 in
    every rank (a context of hundreds of MB and a second or so, inside the save)."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_initialized() else [],
    }


def check(state: Any, rank: int | None = None) -> None:
    """check raises ValueError unless `state` is a `capture()` that `restore` can put back,
    tried on generators of its own (this process's are left alone): a checkpoint's record
    that verifies but is not one (another program's file, a damaged writer) fails the reader
    that took it (`rank`'s, named in the message), before anything is applied, so the resume
    falls back to the next older checkpoint (resume.py) instead of failing after it was
    accepted, at every requeue. CUDA states are checked for their type only."""
    it = "its RNG state" if rank is None else f"its RNG state (rank {rank})"
    if not isinstance(state, dict) or not {"python", "torch", "cuda"} <= set(state):
        raise ValueError(f"{it} is not a record of the python, torch and cuda generators")
    try:
        random.Random().setstate(_as_tuple(state["python"]))
        torch.Generator().set_state(state["torch"])
    except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{it} cannot be restored: {said}") from None
    cuda = state["cuda"]
    if not isinstance(cuda, (list, tuple)) or not all(
            isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1
            for t in cuda):
        raise ValueError(f"{it}: its cuda part is not a list of byte tensors")


def restore(state: dict[str, Any]) -> None:
    random.setstate(_as_tuple(state["python"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_initialized():  # a CPU run leaves CUDA alone
        own = own_cuda_state(list(state["cuda"]), torch.cuda.current_device(),
                             torch.cuda.device_count())
        if own is not None:
            torch.cuda.set_rng_state(own)


def own_cuda_state(states: list[torch.Tensor], device: int,
                   visible: int) -> torch.Tensor | None:
    """own_cuda_state is the saved CUDA generator state for this process's device `device`
    (of `visible`): the one state this version saves, or, from a checkpoint of an earlier
    version (which saved every device of the node), the state at the device's index where
    the node's GPUs are seen as they were then. None on another GPU layout (8 GPUs a node
    before, 4 now; one visible GPU per task, where every task's device is 0 and which of the
    saved ones was its own is not recorded): the device keeps the stream of the run's seed.
    Restoring every saved device failed there on every requeue."""
    if len(states) == 1:
        return states[0]
    return states[device] if len(states) == visible and device < visible else None


def seed_rank(seed: int, rank: int) -> None:
    """seed_rank gives each rank its own dropout stream after the shared weight init."""
    random.seed(seed + rank)
    torch.manual_seed(seed + 7919 * (rank + 1))


def _as_tuple(value: Any) -> Any:
    # weights_only loading returns the python state's tuples as they were saved, but a JSON
    # round trip would give lists; random.setstate needs tuples.
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


# python version, words, has gauss_next, torch bytes, cuda states, bytes per cuda state
_HEADER = struct.Struct("<6q")
RNG_BYTES = 16384  # room for a packed state: about 10 KB on CPU, plus 16 bytes per GPU


def pack(state: dict[str, Any]) -> torch.Tensor:
    """pack lays a `capture()` out as one flat uint8 tensor, with no pickling: cheap enough to
    send to the peers at every memory-mode snapshot. Same length on every rank of a job."""
    version, words, gauss = state["python"]
    cuda = [t.contiguous().view(torch.uint8).reshape(-1) for t in state["cuda"]]
    torch_bytes = state["torch"].numpy().tobytes()
    parts = [_HEADER.pack(version, len(words), gauss is not None, len(torch_bytes), len(cuda),
                          cuda[0].numel() if cuda else 0),
             array("Q", words).tobytes(), struct.pack("<d", gauss or 0.0), torch_bytes]
    parts += [t.numpy().tobytes() for t in cuda]
    return torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8)


def pack_into(state: dict[str, Any], out: torch.Tensor) -> None:
    """pack_into writes `pack(state)` at the start of the uint8 tensor `out`."""
    packed = pack(state)
    if packed.numel() > out.numel():
        raise ValueError(f"a packed RNG state takes {packed.numel()} bytes; room for "
                         f"{out.numel()}")
    out[:packed.numel()].copy_(packed)


def unpack(packed: torch.Tensor) -> dict[str, Any]:
    """unpack is the inverse of `pack` (bytes after the packed state are ignored): the same
    dict `capture()` returned."""
    raw = packed.numpy().tobytes()
    version, n_words, has_gauss, n_torch, n_cuda, cuda_len = _HEADER.unpack_from(raw)
    at = _HEADER.size
    words = array("Q")
    words.frombytes(raw[at:at + 8 * n_words])
    at += 8 * n_words
    (gauss,) = struct.unpack_from("<d", raw, at)
    at += 8
    torch_state = torch.frombuffer(bytearray(raw[at:at + n_torch]), dtype=torch.uint8)
    at += n_torch
    cuda = []
    for _ in range(n_cuda):
        cuda.append(torch.frombuffer(bytearray(raw[at:at + cuda_len]), dtype=torch.uint8))
        at += cuda_len
    return {"python": (version, tuple(words), gauss if has_gauss else None),
            "torch": torch_state, "cuda": cuda}
