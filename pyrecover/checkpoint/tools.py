"""What `pyrecover ckpt ...` does with torch: open, verify and convert the checkpoints of a run
directory (listing them is listing.py, without torch; export, which writes the model alone,
is pyrecover/export.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from pyrecover.checkpoint import dcp as dcp_mode
from pyrecover.checkpoint import dcp_io, store, vanilla
from pyrecover.checkpoint import memory as memory_mode
from pyrecover.checkpoint.store import Checkpoint, CheckpointError
from pyrecover.oneline import first_line
from pyrecover.rundir import RunDir, storage_error

log = logging.getLogger("pyrecover")


def load_problem(ckpt: Checkpoint) -> str:
    """load_problem is "" when what a restore reads first of `ckpt` loads safely (DCP's
    metadata through the restricted unpickler, a vanilla file or memory meta through the
    weights-only one), else why not. Cheap: no tensor bytes are read."""
    try:
        if ckpt.mode == dcp_mode.NAME:
            dcp_io.Reader(ckpt.path)
            json.loads((ckpt.path / dcp_mode.EXTRA_FILE).read_text())["config"]["model"]
        elif ckpt.mode == vanilla.NAME:
            vanilla.load_file(ckpt)["model"]
        elif ckpt.mode == memory_mode.NAME:
            memory_mode.first_meta(ckpt.path, list(ckpt.manifest["files"]))["layout"]
        else:
            return f"mode {ckpt.mode!r} is not one this version knows"
    except Exception as exc:
        return f"cannot be read: {type(exc).__name__}: {first_line(exc)}"
    return ""


def model_problem(ckpt: Checkpoint, recorded: dict | None) -> str:
    """model_problem is "" when `ckpt` was made for the model `recorded` (run.yaml's model
    section; None: not known), else which keys differ: a checkpoint copied in from another
    run verifies, but no restore into this run's model can load it."""
    if not recorded:
        return ""
    try:
        made = config_of(ckpt)["model"]
    except Exception as exc:
        return f"cannot be read: {type(exc).__name__}: {first_line(exc)}"
    differ = [f"model.{k} {made.get(k)!r}, run.yaml {v!r}" for k, v in sorted(recorded.items())
              if k in made and made[k] != v]
    if not differ:
        return ""
    return f"made for another model ({'; '.join(differ[:3])}): this run cannot restore it"


def pick(run: RunDir, step: int | None) -> Checkpoint:
    """pick returns the checkpoint of `step` (or the newest valid one), verified."""
    return next(candidates(run, step))


def candidates(run: RunDir, step: int | None) -> Iterator[Checkpoint]:
    """candidates yields the checkpoint of `step`, or every valid one newest first, verified
    and loading safely; raises CheckpointError when there is none (more)."""
    if step is not None:
        ckpt = store.verify(store.step_folder(run, step))
        if problem := load_problem(ckpt):
            raise CheckpointError(f"checkpoint step {step} is invalid: {problem}")
        yield ckpt
        return
    for found, _, ckpt, problem in store.scan(run.checkpoints):
        if ckpt is not None:
            problem = load_problem(ckpt)
            if not problem:
                yield ckpt
                continue
        log.warning("warning: checkpoint step %d is invalid, skipped: %s", found, problem)
    raise CheckpointError(f"{run.root} has no valid checkpoint")


def model_state(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """model_state reads the model weights of a checkpoint of any mode, in one process."""
    if ckpt.mode == vanilla.NAME:
        return dict(vanilla.load_file(ckpt)["model"])
    if ckpt.mode == dcp_mode.NAME:
        import torch.distributed.checkpoint as dcp

        from pyrecover.model import GPT, GPTConfig

        extra = json.loads((ckpt.path / dcp_mode.EXTRA_FILE).read_text())
        model = GPT(GPTConfig(**extra["config"]["model"]))
        state = {"model": model.state_dict()}
        with dcp_mode.quiet_single_process():
            dcp.load(state, storage_reader=dcp_io.Reader(ckpt.path), no_dist=True)
        return state["model"]
    if ckpt.mode == memory_mode.NAME:
        segments, meta = memory_mode.assemble(ckpt.path, list(ckpt.manifest["files"]))
        model = memory_mode.unflatten(segments, meta["layout"], meta.get("aliases"))[0]
        # Views of the model's segment: torch.save would write all of it for each one. A tied
        # head stays the embedding's tensor, as in a vanilla checkpoint's model.
        clones: dict[int, torch.Tensor] = {}
        for v in model.values():
            if id(v) not in clones:
                clones[id(v)] = v.clone()
        return {k: clones[id(v)] for k, v in model.items()}
    raise CheckpointError(f"{ckpt.path}: mode {ckpt.mode!r} cannot be read here")


def first_that_works(run: RunDir, step: int | None, use) -> tuple[Checkpoint, object]:
    """first_that_works calls `use(ckpt)` on the checkpoint of `step`, or on the newest valid
    one, falling back to the next older while `use` fails to read one (named as invalid)."""
    for ckpt in candidates(run, step):
        try:
            return ckpt, use(ckpt)
        except Exception as exc:
            problem = f"cannot be read: {type(exc).__name__}: {first_line(exc)}"
            if step is not None:
                raise CheckpointError(f"checkpoint step {ckpt.step} is invalid: {problem}"
                                      ) from None
            log.warning("warning: checkpoint step %d is invalid, skipped: %s", ckpt.step,
                        problem)
    raise AssertionError("unreachable: candidates() raises when it runs out")


class temporary:
    """temporary yields a temporary path next to `out` and renames it to `out` on success;
    on failure (the rename included) nothing is left behind, and a failed write (a full disk)
    is one StorageError line."""

    def __init__(self, out: Path) -> None:
        self.out, self.tmp = out, out.with_name(f".{out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                os.replace(self.tmp, self.out)
        except OSError as err:
            exc = err
        finally:
            if self.tmp.is_dir() and not self.tmp.is_symlink():
                shutil.rmtree(self.tmp, ignore_errors=True)
            elif self.tmp.exists() or self.tmp.is_symlink():
                self.tmp.unlink()
        err = _os_error(exc)
        if err is not None:  # a full disk, a folder in the way of the rename: a fault, exit 1
            raise storage_error("write", self.out, err) from None


def _os_error(exc: BaseException | None) -> OSError | None:
    """_os_error is the OSError behind `exc`: itself, or one that torch's writers turned into
    their own error (torch.save to a file object reports a failed write as a RuntimeError
    raised while the OSError is handled; DCP wraps each rank's)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError):
            return exc
        seen.add(id(exc))
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: rank -> error
        if isinstance(failures, dict):
            for failure in failures.values():
                found = _os_error(failure[0] if isinstance(failure, tuple) else failure)
                if found is not None:
                    return found
        exc = exc.__cause__ or exc.__context__
    return None


def save_to(obj: object, path: Path) -> None:
    """save_to is torch.save through a file object, so a failed write keeps its OSError."""
    with open(path, "wb") as f:
        torch.save(obj, f)


def config_of(ckpt: Checkpoint) -> dict:
    """config_of returns the resolved config a checkpoint was made with."""
    if ckpt.mode == dcp_mode.NAME:
        return json.loads((ckpt.path / dcp_mode.EXTRA_FILE).read_text())["config"]
    if ckpt.mode == memory_mode.NAME:
        return memory_mode.first_meta(ckpt.path, list(ckpt.manifest["files"]))["config"]
    return vanilla.load_file(ckpt)["config"]


def _parts_for(cfg: dict):
    from pyrecover import config as config_mod
    from pyrecover.checkpoint.mode import Parts
    from pyrecover.model import GPT, GPTConfig
    from pyrecover.optim import build_optimizer, build_scheduler

    full = config_mod.from_dict(cfg)
    model = GPT(GPTConfig(**cfg["model"]))
    optimizer = build_optimizer(model, full, torch.device("cpu"))
    scheduler = build_scheduler(optimizer, full)
    return Parts(model=model, optimizer=optimizer, scheduler=scheduler, config=cfg,
                 train_state=dict)


def _read_full(ckpt: Checkpoint):
    from pyrecover.checkpoint.dcp import DcpMode
    from pyrecover.checkpoint.vanilla import VanillaMode

    world = int(ckpt.manifest["world_size"])
    parts = _parts_for(config_of(ckpt))
    if ckpt.mode == vanilla.NAME:
        VanillaMode(0, 1).restore(ckpt, parts)
        rngs = list(vanilla.load_file(ckpt)["rng"])
    elif ckpt.mode == dcp_mode.NAME:
        DcpMode(0, 1, torch.device("cpu"), async_save=False).restore(ckpt, parts)
        rngs = [torch.load(ckpt.path / dcp_mode.rng_file(r), weights_only=True)
                for r in range(world)]
    elif ckpt.mode == memory_mode.NAME:
        reader = memory_mode.MemoryMode(0, 1, torch.device("cpu"))  # no peers: reads only
        try:
            reader.restore(ckpt, parts)
        finally:
            reader.close()
        rngs = memory_mode.all_rngs(ckpt.path, list(ckpt.manifest["files"]))
    else:
        raise CheckpointError(f"{ckpt.path}: mode {ckpt.mode!r} cannot be converted here")
    return parts, rngs


def convert(run: RunDir, step: int | None, to: str, out: Path) -> Checkpoint:
    """convert writes the checkpoint of `step` (default: the newest that reads) in the other
    mode's format, and returns the checkpoint it converted.

    `torch`: one file with what a vanilla `state.pt` holds (`torch.load(weights_only=True)`).
    `dcp`: a folder that plain `torch.distributed.checkpoint.load` reads (`model.*`,
    `optim.*`), plus `extra.json` and `rng-<rank>.pt` as a pyrecover dcp checkpoint has.

    `to` and `out` are as listing.convert_target accepted them (before torch's import).
    """
    ckpt, (parts, rngs) = first_that_works(run, step, _read_full)
    train = dict(ckpt.manifest["train_state"])
    with temporary(out) as tmp:
        tmp.parent.mkdir(parents=True, exist_ok=True)  # (convert_target refused a file above)
        if to == "torch":
            save_to(vanilla.full_state(parts, train, rngs), tmp)
        else:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            tmp.mkdir(parents=True)
            model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
            with dcp_mode.quiet_single_process():
                dcp.save({"model": model_sd, "optim": optim_sd},
                         storage_writer=dcp_io.Writer(tmp), no_dist=True)
            extra = {"scheduler": parts.scheduler.state_dict(), "config": parts.config,
                     "train": train}
            (tmp / dcp_mode.EXTRA_FILE).write_text(json.dumps(extra))
            for rank, state in enumerate(rngs):
                save_to(state, tmp / dcp_mode.rng_file(rank))
    return ckpt
