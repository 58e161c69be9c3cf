"""Fault injection for tests and demonstrations: a hard kill at an exact point.

`PYRECOVER_KILL_AT_STEP=N` makes the rank named by `PYRECOVER_KILL_RANK` (default 0) send
SIGKILL to its whole process group (`PYRECOVER_KILL_TARGET=group`, the default: with
`--nproc` that is the launcher and every worker, like `kill -9 -PGID` from a shell) or to
itself only (`self`: one crashed rank). Where, is `PYRECOVER_KILL_POINT`:

- `step` (default): right after step N and its checkpoint bookkeeping;
- `save`: inside the background write of step N's checkpoint, before it is committed.

Nothing is flushed or saved first; that is the point. Unset, this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal


def maybe_kill(step: int, rank: int, point: str = "step") -> None:
    at = os.environ.get("PYRECOVER_KILL_AT_STEP")
    if at is None or int(at) != step or int(os.environ.get("PYRECOVER_KILL_RANK", "0")) != rank:
        return
    if os.environ.get("PYRECOVER_KILL_POINT", "step") != point:
        return
    if os.environ.get("PYRECOVER_KILL_TARGET", "group") == "self":
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)
