"""Resume: restore the newest checkpoint that loads on every rank, falling back past any that
does not (a manifest whose mode disagrees with its files, another model's shapes, a file the
weights-only unpickler refuses), each reported by name as invalid."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch.distributed as tdist

from pyrecover.checkpoint.mode import Parts, Restored
from pyrecover.checkpoint.store import Checkpoint, CheckpointError


def resume_newest(manager: Any, accept: Callable[[Restored], Any],
                  on_chosen: Callable[[Checkpoint], Any]) -> tuple[Checkpoint, Restored] | None:
    """resume_newest is `CheckpointManager.resume` (see there); `manager` is that manager (not
    imported here: the manager imports this module)."""
    initial = None
    below: int | None = None
    while (ckpt := manager.find_resume(below)) is not None:
        initial = initial or _copy_state(manager.parts)
        on_chosen(ckpt)
        error, restored = "", None
        try:
            restored = manager.restore(ckpt)
            accept(restored)
        except (Exception, _dcp_exception()) as exc:  # DCP's is a BaseException
            error = f"{type(exc).__name__}: {_first_line(exc)}"
        errors = [error]
        if tdist.is_initialized() and manager.world_size > 1:
            errors = [None] * manager.world_size
            tdist.all_gather_object(errors, error)
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        if not failed:
            assert restored is not None
            return ckpt, restored
        if manager.rank == 0:
            manager._report_invalid(ckpt.step, ckpt.path, f"cannot be restored ({failed})")
        below = ckpt.step
    if initial is not None:
        _load_state(manager.parts, initial)
    return None


def _dcp_exception() -> type[BaseException]:
    """_dcp_exception is torch's wrapper of every rank's failure inside dcp.load (a
    BaseException), where DCP is loaded; a run that never imported DCP cannot raise it, and
    importing it here would cost every start a second (pyrecover imports DCP lazily)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return getattr(api, "CheckpointException", CheckpointError)


def _first_line(exc: BaseException) -> str:
    failures = getattr(exc, "failures", None)  # DCP's wrapper: the ranks' own errors matter
    if isinstance(failures, dict) and failures:
        return "; ".join(sorted({f"{type(e).__name__}: {_first_line(e)}"
                                 for e, _ in failures.values()}))
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def _copy_state(parts: Parts) -> dict[str, Any]:
    """_copy_state is a CPU copy of the parts' state, taken before a restore is tried."""
    import copy

    return {"model": {k: v.detach().to("cpu", copy=True)
                      for k, v in parts.model.state_dict().items()},
            "optimizer": copy.deepcopy(parts.optimizer.state_dict()),
            "scheduler": copy.deepcopy(parts.scheduler.state_dict())}


def _load_state(parts: Parts, state: dict[str, Any]) -> None:
    parts.model.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
