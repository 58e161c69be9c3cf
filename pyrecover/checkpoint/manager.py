"""The checkpoint manager: when to save, the commit, retention, and which checkpoint to resume.

Every rank calls `at_step` at every step boundary, so the few collectives it needs (agreeing
on the temporary folder, on whether a background write has finished everywhere, gathering
each rank's file checksums) always line up. A checkpoint is committed by rank 0 only after
every rank reported its files durable and hashed; a `checkpoint` event therefore always names
a folder that exists and verifies. A save that fails on any rank is discarded as a whole and
the previous checkpoint stays the newest.

Rank 0 alone decides which checkpoint to resume from (verifying checksums once, not on every
rank) and tells the others.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as tdist

from pyrecover.checkpoint import retention, store
from pyrecover.checkpoint.interval import AutoInterval, Clock
from pyrecover.checkpoint.mode import (
    ModeSettings,
    Parts,
    Restored,
    Snapshotting,
    TrainArg,
    train_now,
)
from pyrecover.checkpoint.modes import make_mode
from pyrecover.checkpoint.resume import (
    NotReadableHere,
    ResumeFailed,
    rank0_choice,
    resume_newest,
)
from pyrecover.checkpoint.stall import InFlight, Laps, StallClock
from pyrecover.checkpoint.store import Checkpoint, CheckpointError, Pending
from pyrecover.oneline import said_once
from pyrecover.rundir import RunDir

log = logging.getLogger("pyrecover")


class SaveFailed(RuntimeError):
    """The checkpoint a run must leave behind (its final one, or the one on a stop request)
    could not be written. Exit code 1: the job is requeued and resumes from the newest valid
    checkpoint."""


class CheckpointManager:
    def __init__(self, run: RunDir, mode: str, interval: int, keep: int, rank: int,
                 world_size: int, parts: Parts, device: torch.device | None = None,
                 async_save: bool = True, snapshot_interval: int = 0, replicas: int = 2,
                 ranks_per_node: int | None = None) -> None:
        self.run, self.mode_name, self.interval, self.keep = run, mode, interval, keep
        self.rank, self.world_size, self.parts = rank, world_size, parts
        self.root = run.checkpoints
        self.mode = make_mode(mode, rank, world_size, ModeSettings(
            device or torch.device("cpu"), async_save, replicas, ranks_per_node))
        # A snapshotting mode only: steps between in-memory snapshots (0: none).
        self.snapshot_interval = (snapshot_interval if isinstance(self.mode, Snapshotting)
                                  else 0)
        self.inflight: InFlight | None = None
        self.last_saved_step: int | None = None
        self.last_error = ""  # why the newest save failed, if it did
        self.failed_step: int | None = None
        self.retention = retention.Retention(self.root, keep)  # checkpoints beyond `keep`
        self.stall_seconds = 0.0  # time the loop was blocked by saves, summed
        self._clock = StallClock()  # the host's blocked spans, so a device wait counts once
        self._laps = Laps()  # which save each blocked second was for (its `blocked`)
        self.last_save_seconds = 0.0  # start to commit of the newest checkpoint (rank 0)
        self.auto: AutoInterval | None = None  # `checkpoint.interval: auto` (see _retune)
        self._prepared = False  # the mode's buffers are allocated (at the first step boundary)
        self.chosen: Future | None = None  # rank 0's first pick, begun early (find_resume)
        self.choice_times: dict[str, float] = {}  # rank 0's newest pick: its seconds

    # --- saving --------------------------------------------------------------------------

    def at_step(self, step: int, final: bool = False) -> float:
        """at_step commits finished background saves and starts the one due at `step`; returns
        the seconds it added to the loop's stall (its own, and the device's waits at fences
        that ended since the last count)."""
        stall_before = self.stall_seconds
        started = self._clock.begin()
        self._laps.open(started)
        self._count_device_wait()
        snap = bool(self.snapshot_interval) and step % self.snapshot_interval == 0
        # A boundary with nothing to do is no wait for a save (a run saving nothing had one).
        busy = self.inflight is not None or final or snap or self._due(step)
        # Buffers for the saves, once the optimizer has its state (after the first update
        # that was not skipped): get_state_dict would make one up with a step of its own.
        if not self._prepared and self.parts.optimizer.state:
            busy = self._prepared = True
            self.mode.prepare(self.parts)
            self._laps.owe()  # the first save's
        clock = Clock(step, started, self.stall_seconds)  # the device's waits until now in it
        if self.auto is not None:
            self.auto.begin(clock)
        if self.inflight is not None:
            self._try_commit(wait=False)
        if snap:
            assert isinstance(self.mode, Snapshotting)
            later = self.parts.train_state_later
            # No wait for the step's numbers: the snapshot reads them once its copy is done.
            self.mode.snapshot(step, self.parts,
                               later() if later is not None else self.parts.train_state())
            self._laps.lap()  # the snapshot's own wait, no save's
        if self._due(step) or final:
            if self.inflight is not None:
                if self.rank == 0:
                    log.warning("checkpoint of step %d is still being written; waiting for it "
                                "before saving step %d", self.inflight.pending.step, step)
                self._commit_now()
            self._start(step, final, clock)
            if self.inflight is not None and (final or not self.mode.asynchronous):
                self._commit_now()
        self._laps.close(self.inflight, counted=busy)
        self.stall_seconds += self._clock.end(started) if busy else self._clock.forget()
        return self.stall_seconds - stall_before

    def before_update(self) -> float:
        """before_update is called just before the optimizer (or the scheduler) changes the
        state: a background save that is still copying the state waits here until its copy
        is complete. Returns the seconds the loop waited (also counted as blocked)."""
        # Snapshots are no disk save in flight but may be copying too.
        if self.inflight is None and not self.snapshot_interval:
            return 0.0
        started = self._clock.begin()
        self.mode.wait_staged()
        waited = self._clock.end(started)
        self.stall_seconds += waited
        if self.inflight is not None:
            self.inflight.blocked += waited
        return waited

    def _count_device_wait(self, drain: bool = False) -> None:
        """_count_device_wait adds the time the device stood still at the fences (CUDA) to the
        loop's stall where the host was not blocked already (stall.py): the host may have
        gone on there, the GPU did not."""
        waited = self._clock.device(self.mode.device_waits(drain))
        self.stall_seconds += waited
        if self.inflight is not None:
            self.inflight.blocked += waited

    def finish(self, step: int) -> None:
        """finish makes sure the checkpoint of `step` is committed before the process exits."""
        tries = 1 if self.failed_step == step else 2  # a failed write is tried once more
        self._laps.open(time.perf_counter())  # in `blocked`; the ledger's stop span, no stall
        if self.inflight is not None:
            tries -= self.inflight.pending.step == step
            self._commit_now()
        while self.last_saved_step != step and step > 0 and tries > 0:
            if self.failed_step == step:
                log.warning("writing the checkpoint of step %d again", step)
            tries -= 1
            self._start(step)
            if self.inflight is not None:
                self._commit_now()
        self._laps.close(None, counted=False)
        self._count_device_wait(drain=True)
        self.mode.close()
        self.retention.wait()
        if self.last_saved_step != step and step > 0:
            newest = store.committed_steps(self.root)
            raise said_once(SaveFailed(  # every rank's error, gathered at the commit
                f"the checkpoint of step {step} could not be written ({self.last_error}); "
                + (f"the newest valid one is step {newest[0][0]}" if newest else "there is no "
                   "valid checkpoint yet") + "; fix the storage, then run the same command again "
                + ("to resume from it" if newest else "to start over at step 0")), self.rank)

    def persist_after_failure(self) -> None:
        """persist_after_failure saves what this rank holds after a peer died (memory mode).

        Uses no collective; the next start's rank 0 commits the result if it covers every
        slice of one step.
        """
        if not isinstance(self.mode, Snapshotting):
            return
        try:
            steps = self.mode.persist_survivor(self.root)
        except Exception as exc:  # the original failure matters more than this one
            log.error("rank %d could not persist its snapshots: %s", self.rank, exc)
            return
        if steps:
            log.warning("rank %d persisted its in-memory snapshots of steps %s", self.rank, steps)
            self.run.event("snapshot_persisted", rank=self.rank, steps=steps)

    def _start(self, step: int, final: bool = False, clock: Clock | None = None) -> None:
        started = time.perf_counter()
        pending = self._begin(step)
        if pending is None:  # the storage refused the folder: this save failed, on every rank
            return
        later = self.parts.train_state_later
        if later is not None and self.mode.asynchronous and not final:
            # No wait for the step's numbers (the GPU would drain): the save's thread reads
            # them after its copy, and the commit reads the same (cached) answer.
            train: TrainArg = functools.cache(later())
        else:
            train = self.parts.train_state()
        self.mode.start(pending, self.parts, train)
        self.inflight = InFlight(pending, train, started, self._laps.start())
        if self.auto is not None:  # the next save is due counted from this one's start
            self.inflight.since, self.inflight.clock = self.auto.started(
                clock or Clock(step, started, self.stall_seconds))

    def _begin(self, step: int) -> Pending | None:
        path: list[Any] = [None, ""]
        if self.rank == 0:
            try:
                path = [str(store.begin(self.root, step).tmp), ""]
            except OSError as exc:  # read-only, full, the run directory gone
                path = [None, f"{type(exc).__name__}: {exc}"]
        if tdist.is_initialized() and self.world_size > 1:
            tdist.broadcast_object_list(path, src=0)
        if path[0] is None:
            self.last_error, self.failed_step = path[1], step
            if self.rank == 0:
                log.warning("checkpoint of step %d failed: %s", step, path[1])
                self.run.event("checkpoint_failed", step=step, reason=path[1])
            return None
        return Pending(root=self.root, step=step, tmp=Path(path[0]))

    def commit_inflight(self) -> None:
        """commit_inflight waits for the background save in flight, if any, and commits it.
        Collective: every rank calls it at the same step."""
        if self.inflight is not None:
            self._commit_now()

    def _commit_now(self) -> None:
        if not self._try_commit(wait=True):
            raise RuntimeError("a checkpoint write reported no result after it was waited for")

    def _try_commit(self, wait: bool) -> bool:
        assert self.inflight is not None
        local = self.mode.result(wait)  # None while still writing
        if self.world_size > 1 and tdist.is_initialized():
            flag = torch.tensor([0 if local is None else 1], dtype=torch.int32)
            tdist.all_reduce(flag, op=tdist.ReduceOp.MIN)
            results = [None] * self.world_size
            if flag.item():
                tdist.all_gather_object(results, local)
        else:
            results = [local]
        if any(r is None for r in results):  # still writing: the poll was this save's wait
            self.inflight.blocked += self._laps.lap()
            return False
        self._count_device_wait(drain=True)  # its copy's fence, in its own `blocked`
        flight, self.inflight = self.inflight, None
        errors = [f"rank {r}: {res.error}" for r, res in enumerate(results) if res.error]
        self.last_error = "; ".join(errors)
        if errors:
            self.failed_step = flight.pending.step
        refused = self._commit_or_abort(flight, results, self.last_error) if self.rank == 0 \
            else ""
        if not errors and self.world_size > 1 and tdist.is_initialized():
            said = [refused]  # rank 0's commit itself may fail: every rank learns of it
            tdist.broadcast_object_list(said, src=0)
            refused = said[0]
        if refused and not errors:
            self.last_error, self.failed_step, errors = refused, flight.pending.step, [refused]
        if not errors:
            self.last_saved_step = flight.pending.step
            if self.auto is not None:
                self._retune(flight)
        return True

    def _due(self, step: int) -> bool:
        """_due: a fixed interval saves at its multiples (aligned across restarts); `auto` saves
        `interval` steps after the previous save began, or the attempt's first step."""
        if self.auto is None:
            return step % self.interval == 0
        return self.auto.due(step, self.interval)

    def _retune(self, flight: InFlight) -> None:
        """_retune re-chooses the interval (checkpoint/interval.py) after a commit from rank 0's
        measured step time and stall; every rank takes rank 0's choice (one broadcast), so
        saves stay collective."""
        assert self.auto is not None
        self.auto.observe_steps(flight.since, flight.clock)
        self.auto.observe_stall(flight.blocked)  # the whole save's, its commit included
        choice = torch.tensor([self.auto.propose()], dtype=torch.int64)
        if tdist.is_initialized() and self.world_size > 1:
            tdist.broadcast(choice, src=0)
        steps = int(choice.item())
        if steps != self.interval and self.rank == 0:
            log.info("checkpoint interval %d -> %d steps (auto: save stall %.3fs, step %.3fs, "
                     "MTBF %.1fh)", self.interval, steps, self.auto.stall_s, self.auto.step_s,
                     self.auto.mtbf_s / 3600)
            self.run.event("checkpoint_interval", step=flight.pending.step, interval=steps,
                           stall_seconds=round(self.auto.stall_s, 4),
                           step_seconds=round(self.auto.step_s, 5),
                           mtbf_hours=round(self.auto.mtbf_s / 3600, 3))
        self.interval = steps

    def _commit_or_abort(self, flight: InFlight, results: list[Any], error: str) -> str:
        """_commit_or_abort commits rank 0's pending save or discards it; returns why a commit
        that every rank's files allowed failed itself ("" where it did not)."""
        pending = flight.pending
        if not error:
            for res in results:
                pending.files.update(res.files)
            try:  # a quota hit by manifest.json, the last write; EIO at an fsync
                folder = pending.commit(self.mode_name, self.world_size, train_now(flight.train),
                                        keep_replaced=pending.step in self.retention.skipped)
            except OSError as exc:
                error = f"rank 0's commit: {type(exc).__name__}: {exc}"
                self._discard(pending, error)
                return error
        else:
            self._discard(pending, error)
            return ""
        self.retention.after_commit(pending.step)  # the newest `keep` at or below it stay
        flight.blocked += self._laps.lap()  # to here: its fsyncs, its manifest, retention
        seconds = time.perf_counter() - flight.started  # its start to here, as `blocked`
        self.last_save_seconds = seconds
        size = sum(f["size"] for f in pending.files.values())
        self.run.event("checkpoint", step=pending.step, mode=self.mode_name, path=str(folder),
                       bytes=size, seconds=round(seconds, 4), blocked=round(flight.blocked, 4))
        log.info("checkpoint step %d committed: %s (%.1f MB, loop blocked %.3fs, %.3fs in all)",
                 pending.step, folder, size / 1e6, flight.blocked, seconds)
        return ""

    def _discard(self, pending: Pending, error: str) -> None:
        pending.abort()
        log.warning("checkpoint of step %d failed and was discarded: %s", pending.step, error)
        self.run.event("checkpoint_failed", step=pending.step, reason=error)

    # --- resuming ------------------------------------------------------------------------
    def find_resume(self, below: int | None = None) -> Checkpoint | None:
        """find_resume picks the newest checkpoint that verifies (rank 0) and agrees on it;
        with `below`, the newest older than that step.

        Uncommitted temporary folders are removed; corrupt checkpoints are reported and kept,
        never loaded. Rank 0's first pick is `self.chosen` (resume.choose_in_background)."""
        choice: list[Any] = [None]
        found: Checkpoint | None = None
        failed: BaseException | None = None
        if self.rank == 0:
            chosen, self.chosen = self.chosen, None
            found, choice[0], self.choice_times, failed = rank0_choice(
                chosen if below is None else None, self.root, below, self.run.event,
                self._report_invalid)
        if tdist.is_initialized() and self.world_size > 1:
            tdist.broadcast_object_list(choice, src=0)
        if failed is not None:  # raised once every rank knows: none waits for rank 0
            raise failed
        if isinstance(choice[0], dict):
            raise ResumeFailed(choice[0].get("refused") or
                               f"rank 0 could not choose a checkpoint: {choice[0]['failed']}")
        if choice[0] is None or found is not None:
            return found
        # Other ranks trust rank 0's checksum pass; the sizes are cheap to check again. One
        # this rank cannot read (NFS a moment after rank 0's rename) fails its restore: the
        # ranks then fall back together (resume.py), never exit as if the user had erred.
        try:
            return store.verify(Path(choice[0]), checksums=False)
        except (CheckpointError, OSError) as exc:
            raise NotReadableHere(f"{type(exc).__name__}: {exc}") from exc

    def _report_invalid(self, step: int, folder: Path, problem: str) -> None:
        self.retention.skipped.add(step)  # never counted by retention (retention.py)
        log.warning("skipping checkpoint step %d: invalid: %s", step, problem)
        self.run.event("checkpoint_invalid", step=step, path=str(folder), reason=problem)

    def restore(self, ckpt: Checkpoint) -> Restored:
        """restore loads `ckpt` (of any mode) into the live parts and returns the train state."""
        mode = self.mode if ckpt.mode == self.mode_name else make_mode(
            ckpt.mode, self.rank, self.world_size,
            ModeSettings(torch.device("cpu"), async_save=False, replicas=1))
        return mode.restore(ckpt, self.parts)

    def resume(self, accept: Callable[[Restored], Any] = lambda r: r,
               on_chosen: Callable[[Checkpoint], Any] = lambda c: None,
               keep_weights: bool = True) -> tuple[Checkpoint, Restored] | None:
        """resume restores the newest checkpoint that loads on every rank, or returns None
        where none verifies.

        A checkpoint that verifies but cannot be restored (a manifest whose mode disagrees
        with its files, another model's shapes, a file the weights-only unpickler refuses, a
        train state `accept` rejects, a file another rank cannot read) is reported by name as
        invalid and the next older one is tried. When none of those loads, the parts get back
        the state they had before the first try and ResumeFailed is raised on every rank: a
        start from step 0 would bury them under its own commits (exit 1, so a transient fault
        gets another try).
        `on_chosen` is told of each checkpoint before its restore starts (phase timings).
        Without `keep_weights` the model's weights are not put back (nor copied beforehand):
        for a caller that initializes them itself when this returns None.
        """
        return resume_newest(self, accept, on_chosen, keep_weights)
