"""What `pyrecover ckpt ...` does with torch: open, verify and convert the checkpoints of a run
directory (listing them is listing.py, without torch; export, which writes the model alone,
is pyrecover/export.py)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from pyrecover.checkpoint import modes, store
from pyrecover.checkpoint.mode import ModelBuilder, Parts
from pyrecover.checkpoint.store import Checkpoint, CheckpointError
from pyrecover.oneline import first_line
from pyrecover.rundir import RunDir, storage_error

log = logging.getLogger("pyrecover")


def load_problem(ckpt: Checkpoint) -> str:
    """load_problem is "" when what a restore reads first of `ckpt` loads safely (DCP's
    metadata through the restricted unpickler, a vanilla file or memory meta through the
    weights-only one), else why not. Cheap: no tensor bytes are read."""
    if ckpt.mode not in modes.OFFLINE:
        return f"mode {ckpt.mode!r} is not one this version knows"
    try:
        modes.offline(ckpt.mode).check_readable(ckpt)
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


def model_state(ckpt: Checkpoint, build_model: ModelBuilder) -> dict[str, torch.Tensor]:
    """model_state reads the model weights of a checkpoint of any mode, in one process."""
    return modes.offline(ckpt.mode).read_model(ckpt, build_model)


def config_of(ckpt: Checkpoint) -> dict:
    """config_of returns the resolved config a checkpoint was made with."""
    return modes.offline(ckpt.mode).read_config(ckpt)


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
    is one StorageError line; a folder this user may not write, the CLI's permission line."""

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
        if isinstance(err, PermissionError):  # the user's folder: no retry helps, exit 2
            raise PermissionError(err.errno, err.strerror, str(self.out.parent)) from None
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


def convert(run: RunDir, step: int | None, to: str, out: Path,
            build_parts: Callable[[dict], Parts]) -> Checkpoint:
    """convert writes the checkpoint of `step` (default: the newest that reads) in the format
    `to` (modes.CONVERT_TO), and returns the checkpoint it converted; `build_parts` makes the
    live objects of a config for the state to be loaded into (pyrecover/offline.py).

    `torch`: one file with what a vanilla `state.pt` holds (`torch.load(weights_only=True)`).
    `dcp`: a folder that plain `torch.distributed.checkpoint.load` reads (`model.*`,
    `optim.*`), plus `extra.json` and `rng-<rank>.pt` as a pyrecover dcp checkpoint has.

    `to` and `out` are as listing.convert_target accepted them (before torch's import).
    """
    def read(ckpt: Checkpoint) -> tuple[Parts, list[dict]]:
        parts = build_parts(config_of(ckpt))
        return parts, modes.offline(ckpt.mode).read_all(ckpt, parts)

    ckpt, (parts, rngs) = first_that_works(run, step, read)
    with temporary(out) as tmp:
        tmp.parent.mkdir(parents=True, exist_ok=True)  # (convert_target refused a file above)
        modes.writer(to).write_all(tmp, parts, dict(ckpt.manifest["train_state"]), rngs)
    return ckpt
