"""Fault injection for tests and demonstrations: a hard kill at an exact point.

`PYRECOVER_KILL_AT_STEP=N` makes the ranks named by `PYRECOVER_KILL_RANK` (default 0; a
comma-separated list names several) send SIGKILL to its whole process group
(`PYRECOVER_KILL_TARGET=group`, the default: with `--nproc` that is the launcher and every
worker, like `kill -9 -PGID` from a shell) or to itself only (`self`: one crashed rank).
Where, is `PYRECOVER_KILL_POINT`:

- `step` (default): right after step N and its checkpoint bookkeeping;
- `save`: inside the background write of step N's checkpoint, before it is committed;
- `exchange`: in memory mode, inside the background replica exchange of step N's snapshot,
  before anything is sent;
- `snapshot`: in memory mode, at step N's snapshot, once this rank's exchange of the previous
  snapshot has finished and before step N's is copied. Every rank took part in that exchange,
  so the previous snapshot is complete on every survivor whatever the timing: a test that
  needs to know the newest complete snapshot kills here, not at `step`.

`PYRECOVER_KILL_ONCE=PATH` (optional) makes the kill happen once only: it goes ahead only
if PATH does not exist yet, and creates PATH first. The environment is inherited by a
requeued or restarted run, which redoes step N after resuming from an earlier checkpoint;
the guard file keeps that run from being killed again.

Nothing is flushed or saved first; that is the point. Unset, this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal


def maybe_kill(step: int, rank: int, point: str = "step") -> None:
    at = os.environ.get("PYRECOVER_KILL_AT_STEP")
    ranks = os.environ.get("PYRECOVER_KILL_RANK", "0").split(",")
    if at is None or int(at) != step or str(rank) not in ranks:
        return
    if os.environ.get("PYRECOVER_KILL_POINT", "step") != point:
        return
    once = os.environ.get("PYRECOVER_KILL_ONCE")
    if once:
        try:  # O_EXCL: exactly one process, in one run, gets to create the guard
            os.close(os.open(once, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            return
    if os.environ.get("PYRECOVER_KILL_TARGET", "group") == "self":
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def maybe_delay() -> None:
    """maybe_delay sleeps `PYRECOVER_STEP_DELAY` seconds per step: a slow model on a tiny one.

    Lets tests stretch a run across a SLURM time limit without changing what it computes.
    """
    delay = os.environ.get("PYRECOVER_STEP_DELAY")
    if delay:
        import time

        time.sleep(float(delay))
