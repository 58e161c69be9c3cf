"""Vanilla mode: rank 0 writes the whole training state as one `torch.save` file.

The seed projects' baseline, kept because it is simple and portable: one file any PyTorch
can read. It is written through `HashedFile`, like DCP's and memory mode's files: checksummed
from memory while written (in parallel blocks), so it costs no second pass over the bytes.
Every rank reads the same file, memory-mapped, so a load costs page-cache hits rather than
one private copy of the file per rank.

With `train.parallel: fsdp` the shards are gathered onto rank 0 to write the same single file
(the slow path: the whole state passes through one rank's memory, and sizes above
`checkpoint.gather_max_gb` are refused at start; dcp writes each rank's own shards instead).
"""

from __future__ import annotations

from typing import Any

import torch

from pyrecover import dist
from pyrecover.checkpoint import rng
from pyrecover.checkpoint.hashed_file import HashedFile
from pyrecover.checkpoint.mode import Checkpoint, Parts, Pending, Restored, WriteResult

NAME = "vanilla"
STATE_FILE = "state.pt"


def full_state(parts, train: dict[str, Any], rngs: list[dict[str, Any]],
               gathered: tuple[dict, dict] | None = None) -> dict[str, Any]:
    """full_state is everything a vanilla file holds, as plain tensors and data; `gathered`
    is a sharded model's (model, optimizer) state from `gather_sharded`."""
    model, optimizer = gathered or (parts.model.state_dict(), parts.optimizer.state_dict())
    return {
        "model": model,
        "optimizer": optimizer,
        "scheduler": parts.scheduler.state_dict(),
        "train": train,
        "rng": rngs,
        "config": parts.config,
    }


def _param_names(parts) -> list[str]:
    """_param_names are the optimizer's parameters' names in its own order: the order
    `optimizer.state_dict()` numbers them in."""
    names = {id(p): n for n, p in parts.model.named_parameters()}
    return [names[id(p)] for group in parts.optimizer.param_groups for p in group["params"]]


def gather_sharded(parts) -> tuple[dict, dict] | None:
    """gather_sharded is a sharded (FSDP) model's whole state on rank 0, as DDP's
    `state_dict()`s would hold it (the optimizer's state numbered, not named), so the file is
    the same whichever way the run was parallel; None where the model is not sharded.
    Collective: every rank calls it; the others get empty dicts. The slow path: all of it
    passes through rank 0's memory (`checkpoint.gather_max_gb` bounds it)."""
    from pyrecover import parallel

    if not parallel.is_sharded(parts.model):
        return None
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = _tie(parts, get_model_state_dict(parts.model, options=opts))
    named = get_optimizer_state_dict(parts.model, parts.optimizer, options=opts)
    if not named:
        return {}, {}
    index = {name: i for i, name in enumerate(_param_names(parts))}
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]
    return model, {"state": {index[n]: v for n, v in named["state"].items()},
                   "param_groups": groups}


def _tie(parts, model: dict[str, Any]) -> dict[str, Any]:
    """_tie makes the gathered entries of one shared parameter (the head tied to the token
    embedding) one tensor again, as in DDP's `state_dict()`: gathered with cpu_offload each
    name got its own copy, and the file held the largest weight twice."""
    first: dict[int, str] = {}
    for name, p in parts.model.named_parameters(remove_duplicate=False):
        if name not in model:
            continue
        if id(p) in first:
            model[name] = model[first[id(p)]]
        else:
            first[id(p)] = name
    return model


def load_sharded(parts, state: dict[str, Any]) -> None:
    """load_sharded loads a vanilla file's whole state into a sharded model: every rank has
    the file mapped and keeps its own shards of it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(parts.model, state["model"], options=opts)
    names = _param_names(parts)
    saved = state["optimizer"]
    named = {"state": {names[i]: v for i, v in saved["state"].items()},
             "param_groups": [{**g, "params": [names[i] for i in g["params"]]}
                              for g in saved["param_groups"]]}
    set_optimizer_state_dict(parts.model, parts.optimizer, named, options=opts)


def write_state(path, state: dict[str, Any]) -> dict[str, Any]:
    """write_state `torch.save`s `state` to `path`, fsynced, and returns its manifest entry.
    A failed write (a full disk) raises the OSError, not torch's RuntimeError around it."""
    with HashedFile(str(path)) as out:
        try:
            torch.save(state, out)
        except RuntimeError as exc:
            if isinstance(out.error, OSError):
                raise out.error from exc
            raise
        return out.close()


def load_file(ckpt: Checkpoint) -> dict[str, Any]:
    """load_file maps the state file into memory; only tensors and plain data are unpickled."""
    return torch.load(ckpt.path / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)


def own_cpu_state(optimizer: torch.optim.Optimizer) -> None:
    """own_cpu_state copies into the process's own memory the optimizer state that stays on
    the CPU: `load_state_dict` keeps those tensors as they came, the state file's mapped
    pages, and the first update would then copy them one page fault at a time (2.4 s more
    than the next update for a 1 GB state on 2 CPU ranks; one copy here costs 0.2-0.5 s).
    The step counters too: any tensor left in the file keeps the whole mapping. State moved
    to a GPU was copied already."""
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                state[key] = value.clone()


class VanillaMode:
    name = NAME
    asynchronous = False

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._result: WriteResult | None = None

    def start(self, pending: Pending, parts: Parts, train: dict[str, Any]) -> None:
        rngs = dist.gather_objects(rng.capture(), self.world_size)  # every rank takes part
        gathered = gather_sharded(parts)  # FSDP: every rank takes part, rank 0 gets it all
        files, error = {}, ""
        if self.rank == 0:
            try:
                pending.files[STATE_FILE] = write_state(
                    pending.tmp / STATE_FILE, full_state(parts, train, rngs, gathered))
                files = dict(pending.files)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
        self._result = WriteResult(files, error)

    def wait_staged(self) -> None:
        pass  # start() returns once the state is written

    def device_waits(self, drain: bool = False) -> list[tuple[float, float]]:
        return []  # nothing is copied behind the loop's back

    def prepare(self, parts: Parts) -> None:
        pass  # nothing is kept between saves

    def result(self, wait: bool) -> WriteResult | None:
        return self._result  # written synchronously in start()

    def restore(self, ckpt: Checkpoint, parts: Parts) -> Restored:
        from pyrecover import parallel

        state = load_file(ckpt)
        if parallel.is_sharded(parts.model):
            load_sharded(parts, state)
        else:
            parts.model.load_state_dict(state["model"])
            parts.optimizer.load_state_dict(state["optimizer"])
            own_cpu_state(parts.optimizer)
        parts.scheduler.load_state_dict(state["scheduler"])
        rngs = _rngs(state)
        mine = rngs[self.rank] if self.rank < len(rngs) else None
        if mine is not None:
            rng.check(mine, self.rank)  # before train.py applies it (rng.check)
        return Restored(train=dict(state["train"]), rng=mine)

    def close(self) -> None:
        pass


# --------------------------------------------- offline: `pyrecover ckpt` (mode.Offline, Writer)

def check_readable(ckpt: Checkpoint) -> None:
    state = load_file(ckpt)  # mapped, not read: the unpickler sees only tensors and plain data
    state["model"]
    for saved in _rngs(state):  # what a resume takes (a few KB a rank)
        rng.check(saved)


def read_config(ckpt: Checkpoint) -> dict[str, Any]:
    return load_file(ckpt)["config"]


def read_model(ckpt: Checkpoint, build_model) -> dict[str, torch.Tensor]:
    return dict(load_file(ckpt)["model"])  # (a tied head is saved as the embedding's tensor)


def read_all(ckpt: Checkpoint, parts: Parts) -> list[dict[str, Any]]:
    VanillaMode(0, 1).restore(ckpt, parts)
    rngs = _rngs(load_file(ckpt))
    for rank, state in enumerate(rngs):
        rng.check(state, rank)
    return rngs


def _rngs(state: dict[str, Any]) -> list[Any]:
    rngs = state.get("rng")
    if not isinstance(rngs, (list, tuple)):
        raise ValueError(f"its RNG records are a {type(rngs).__name__}, not a list")
    return list(rngs)


def write_all(out, parts: Parts, train: dict[str, Any], rngs: list[dict[str, Any]]) -> None:
    write_state(out, full_state(parts, train, rngs))  # what a step's state.pt holds
