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

`PYRECOVER_KILL_ON_FILE=PATH` instead kills when PATH appears, at the first step boundary
after (`bench restart` crashes a running job at a moment of its choosing this way, on any
cluster whose storage the job and the bench share): the first rank named by
`PYRECOVER_KILL_RANK` (where `last` names the job's last rank) to rename PATH to PATH.taken
kills, once per file.

Nothing is flushed or saved first; that is the point (`PYRECOVER_KILL_AFTER_COMMIT=1`
excepted: at a `step` kill every rank first commits the background save in flight, so that
the checkpoint a test expects is there whatever the machine's load). Unset, this costs one
dict lookup.

A hang, for the watchdog (pyrecover/watchdog.py): `PYRECOVER_HANG_AT_STEP=N` makes the ranks
named by `PYRECOVER_HANG_RANK` (default 0, a comma-separated list names several) stop making
progress when step N enters phase `PYRECOVER_HANG_PHASE` (default `forward`; the phase names
are the loop's: data, forward, backward, allreduce, optimizer, checkpoint, sync).
`PYRECOVER_HANG_HOW=sleep` (the default) blocks the loop's thread for good while the others
run on, like a stuck collective; `stop` sends the process SIGSTOP, like a task stopped by the
kernel or a debugger (nothing in it runs, its own watchdog included).
`PYRECOVER_HANG_FOR=SECONDS` ends the stall after that long (a slow phase, not a hang); with
`PYRECOVER_HANG_WRITE_TO=PATH` the stalled rank appends 4 KiB to PATH every 0.2 s meanwhile,
like a slow save that keeps writing. `PYRECOVER_HANG_ONCE=PATH` works as
`PYRECOVER_KILL_ONCE` does.

A bad node, for the health check (pyrecover/health.py): `PYRECOVER_HEALTH_FAIL=NODE` (a
comma-separated list names several) fails the check named by `PYRECOVER_HEALTH_FAIL_CHECK`
(default `storage_write`) on every task of those nodes, matched against SLURMD_NODENAME
(all nodes of the local test cluster share one hostname).

A slow rank, for straggler detection: `PYRECOVER_SLOW_RANK=R` (comma-separated for several)
adds `PYRECOVER_SLOW_S` seconds (default 0.1) to every forward pass of those ranks.

A diverging step, for the loop's guard: `PYRECOVER_NAN_AT_STEPS=2,3,7` makes the loss of
those optimizer steps (counted from 1) NaN on every rank, and so its gradients.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable


def maybe_kill(step: int, rank: int, point: str = "step",
               commit: Callable[[], object] | None = None) -> None:
    """maybe_kill kills where the environment says (see above). With
    `PYRECOVER_KILL_AFTER_COMMIT=1`, every rank first runs `commit` (the loop's: commit the
    background save still in flight, a collective), so a test knows which checkpoint the
    resume finds however long that save takes on a busy machine."""
    at = os.environ.get("PYRECOVER_KILL_AT_STEP")
    if at is None or int(at) != step:
        return
    if os.environ.get("PYRECOVER_KILL_POINT", "step") != point:
        return
    if commit is not None and os.environ.get("PYRECOVER_KILL_AFTER_COMMIT") == "1":
        commit()
    if str(rank) not in os.environ.get("PYRECOVER_KILL_RANK", "0").split(","):
        return
    if not _first_time(os.environ.get("PYRECOVER_KILL_ONCE")):
        return
    _kill()


def maybe_kill_on_file(rank: int, world_size: int) -> None:
    """maybe_kill_on_file kills as `maybe_kill` does once `PYRECOVER_KILL_ON_FILE` exists."""
    path = os.environ.get("PYRECOVER_KILL_ON_FILE")
    if not path:
        return
    names = os.environ.get("PYRECOVER_KILL_RANK", "0").split(",")
    if str(rank) not in names and not ("last" in names and rank == world_size - 1):
        return
    try:  # the rename is the claim: exactly one process kills per file
        os.rename(path, path + ".taken")
    except OSError:
        return
    _kill()


def _kill() -> None:
    if os.environ.get("PYRECOVER_KILL_TARGET", "group") == "self":
        os.kill(os.getpid(), signal.SIGKILL)
    os.killpg(os.getpgrp(), signal.SIGKILL)


def _first_time(guard: str | None) -> bool:
    """_first_time is False when the guard file exists; else creates it and is True."""
    if not guard:
        return True
    try:  # O_EXCL: exactly one process, in one run, gets to create the guard
        os.close(os.open(guard, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    return True


def maybe_hang(phase: str, step: int, rank: int) -> None:
    """maybe_hang stops this rank for good at `phase` of `step`, if the environment says so."""
    at = os.environ.get("PYRECOVER_HANG_AT_STEP")
    if at is None or int(at) != step:
        return
    if str(rank) not in os.environ.get("PYRECOVER_HANG_RANK", "0").split(","):
        return
    if os.environ.get("PYRECOVER_HANG_PHASE", "forward") != phase:
        return
    if not _first_time(os.environ.get("PYRECOVER_HANG_ONCE")):
        return
    import sys
    import time

    print(f"pyrecover fault: rank {rank} hangs in phase {phase} of step {step}",
          file=sys.stderr, flush=True)
    if os.environ.get("PYRECOVER_HANG_HOW", "sleep") == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    end = time.monotonic() + float(os.environ.get("PYRECOVER_HANG_FOR", "inf"))
    write_to = os.environ.get("PYRECOVER_HANG_WRITE_TO")
    if write_to:
        os.makedirs(os.path.dirname(write_to) or ".", exist_ok=True)
    while time.monotonic() < end:
        if write_to:
            with open(write_to, "ab") as f:
                f.write(bytes(4096))
        time.sleep(min(0.2 if write_to else 3600, max(0.0, end - time.monotonic())))


def maybe_slow(rank: int) -> None:
    """maybe_slow sleeps `PYRECOVER_SLOW_S` seconds on the ranks in `PYRECOVER_SLOW_RANK`."""
    ranks = os.environ.get("PYRECOVER_SLOW_RANK")
    if ranks and str(rank) in ranks.split(","):
        import time

        time.sleep(float(os.environ.get("PYRECOVER_SLOW_S", "0.1")))


def maybe_nan(loss, step: int):
    """maybe_nan is `loss`, or NaN where `PYRECOVER_NAN_AT_STEPS` names `step`."""
    steps = os.environ.get("PYRECOVER_NAN_AT_STEPS")
    if steps and str(step) in steps.split(","):
        return loss * float("nan")
    return loss


def maybe_delay() -> None:
    """maybe_delay sleeps `PYRECOVER_STEP_DELAY` seconds per step: a slow model on a tiny one.

    Lets tests stretch a run across a SLURM time limit without changing what it computes.
    """
    delay = os.environ.get("PYRECOVER_STEP_DELAY")
    if delay:
        import time

        time.sleep(float(delay))


def health_fault(node: str) -> str | None:
    """health_fault is the health check to fail on `node`, if the environment names it."""
    nodes = os.environ.get("PYRECOVER_HEALTH_FAIL")
    if not nodes or node not in nodes.split(","):
        return None
    return os.environ.get("PYRECOVER_HEALTH_FAIL_CHECK", "storage_write")
