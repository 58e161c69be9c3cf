"""Resume: restore the newest checkpoint that loads on every rank, falling back past any that
does not (a manifest whose mode disagrees with its files, another model's shapes, a file the
weights-only unpickler refuses), each reported by name as invalid.

Rank 0 chooses (`choose`): it removes what killed saves left, commits a snapshot memory mode's
survivors persisted (`tidy`), and checksums the newest checkpoint's files (`pick`). That pass
reads the whole checkpoint from storage, so a start runs it in the background
(`choose_in_background`) from the moment it holds the run directory, while it builds the
model and the optimizer (whose first use imports torch._dynamo); the read also leaves the
files in the page cache for the restore.

The other ranks wait for that choice with no reading of their own, so their hang watchdog
(watchdog.py) would see no progress and fire after the startup limit while rank 0 still
reads a checkpoint of terabytes, or one on slow storage. While it tidies and picks, rank 0
appends a byte to `<checkpoints>/.verifying` every few seconds in which its checksum pass read
something (`beats`; the file goes once the pick is done), and every rank counts its size as
progress. A read stuck on hung storage gives no beats: the other ranks' watchdogs then fire
after the startup limit, and so does rank 0's, whose own I/O the beats would move too.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as tdist

from pyrecover.checkpoint import checksum, entries, store
from pyrecover.checkpoint.mode import Parts, Restored
from pyrecover.checkpoint.store import Checkpoint, CheckpointError
from pyrecover.oneline import first_line
from pyrecover.readahead import read_through

log = logging.getLogger("pyrecover")

VERIFYING = ".verifying"  # under the checkpoints root: rank 0's beats while it chooses
BEAT_S = 5.0  # far below any startup limit; first beat after it, so a quick pick writes none


class NotReadableHere(RuntimeError):
    """A rank other than 0 cannot read the checkpoint rank 0 chose (CheckpointManager.find_resume);
    its restore fails like any other, so every rank falls back to an older one together."""


class ResumeFailed(RuntimeError):
    """Checkpoints verified but none could be restored on every rank. Exit code 1: the job is
    requeued and tries again (a transient read error, an out-of-memory); every checkpoint is
    left in place."""


@dataclass
class Choice:
    """Choice is rank 0's pick: the newest checkpoint that verifies (None: none does), and
    the newer ones that did not, as (step, folder, problem), newest first."""

    found: Checkpoint | None
    invalid: list[tuple[int, Path, str]] = field(default_factory=list)
    seconds: float | None = None  # how long the pick took, where it ran in the background
    unreadable: str = ""  # the newest that could not be read (store.Unreadable), if any

    def refusal(self) -> str | None:
        """refusal is why a start must not begin from step 0 with this choice: no checkpoint
        verified and one could not even be read (storage trouble, not proof it is bad)."""
        if self.found is not None or not self.unreadable:
            return None
        return (f"no checkpoint could be read; the newest, {self.unreadable}. Every "
                "checkpoint is left in place and the run does not start over: run the same "
                "command again (a requeued job does) once the storage answers")


def tidy(root: Path, on_event: Callable[..., Any]) -> None:
    """tidy is what a start does to `root` before its first pick: remove the temporary folders
    killed saves left, and commit the snapshot memory mode's survivors persisted (`on_event`
    records that). Only under the run directory's lock."""
    if any(root.glob(store.SNAPSHOT_GLOB)):
        from pyrecover.checkpoint.memory import finalize_snapshots

        finalize_snapshots(root, on_event)
    for step in recover_commits(root):
        log.warning("recovered checkpoint step %d: a save that crashed before its folder was "
                    "renamed into place had committed it", step)
        on_event("checkpoint_recovered", step=step)
    for tmp in entries.clean_uncommitted(root):
        log.warning("removed uncommitted checkpoint folder %s", tmp.name)


def recover_commits(root: Path) -> list[int]:
    """recover_commits puts back `step-<N>/` where a commit crashed between writing its
    manifest and renaming its folder into place; returns those steps.

    Replacing a step-N (store.Pending.commit: a resume that redid the step) renames the old
    folder aside, then the new one into place: a crash between the two leaves no step-N, the
    new one complete as `.tmp-step-N-*` and the old one as `.old-step-N-*` (an invalid old one
    is kept as `invalid-step-N-*` and stays so). The first of the two that verifies in full,
    the new one first, becomes step-N again. A lone
    `.old-step-*` is retention's (being deleted) and a `.tmp-step-*` without a manifest a save
    that never committed: clean_uncommitted removes both.
    """
    recovered = []
    if not root.is_dir():
        return recovered
    tmps = [p for p in root.glob(".tmp-step-*")  # (EIO raises: never taken for no manifest)
            if entries.is_file(p / store.MANIFEST)]
    for tmp in sorted(tmps, key=lambda p: (p / store.MANIFEST).stat().st_mtime, reverse=True):
        step = tmp.name.split("-")[2]
        final = (root / store.step_folder_name(int(step))
                 if step.isascii() and step.isdigit() else None)
        if final is None or final.exists() or final.is_symlink():
            continue
        for candidate in (tmp, *root.glob(f".old-step-{step}-*")):
            os.rename(candidate, final)
            try:
                store.verify(final)
            except CheckpointError:
                os.rename(final, candidate)
                continue
            recovered.append(int(step))
            break
    if recovered:
        store.fsync_dir(root)
    return recovered


def pick(root: Path, below: int | None, environ: Mapping[str, str]) -> Choice:
    """pick is the newest checkpoint under `root` that verifies (with `below`, the newest
    older than that step). Checksums are read in full except where `environ`'s job wrote the
    files itself (trust.py). It only reads."""
    choice = Choice(None)
    for step, folder in store.committed_steps(root):
        if below is not None and step >= below:
            continue
        try:
            choice.found = store.verify(folder, environ=environ)
            break
        except store.Unreadable as exc:
            choice.invalid.append((step, folder, str(exc)))
            choice.unreadable = choice.unreadable or f"step {step}: {exc}"
        except CheckpointError as exc:
            choice.invalid.append((step, folder, str(exc)))
    return choice


def choose(root: Path, below: int | None, on_event: Callable[..., Any]) -> Choice:
    """choose is rank 0's part of a resume: `tidy` on a start's first pick (`below` None),
    then `pick`. Only under the run directory's lock."""
    if below is None:
        tidy(root, on_event)
    return pick(root, below, os.environ)


def choose_in_background(root: Path, on_event: Callable[..., Any]) -> Future:
    """choose_in_background is `choose(root, None, on_event)` with the checksum pass in a
    thread of its own: it tidies `root` here and returns the future of the pick
    (CheckpointManager.find_resume takes it as `chosen`). The thread only reads, so the lock
    need not wait for it, and it is a daemon: a start that fails first exits without it.

    Where the pick needed no checksum pass (the same job wrote it: trust.py), nothing has read
    it yet; a vanilla file, which every rank's restore reads whole, is then read once into the
    page cache after the future is set, so the restore does not wait on storage."""
    beating = _Beats(root / VERIFYING, BEAT_S).start()
    future: Future = Future()
    try:
        tidy(root, on_event)
    except Exception as exc:  # (a checkpoints folder it may not read): said at the choice,
        beating.stop()  # where every rank learns of it
        future.set_exception(exc)
        return future
    except BaseException:
        beating.stop()
        raise

    def work() -> None:
        started = time.perf_counter()
        try:
            choice = pick(root, None, os.environ)
        except BaseException as exc:  # handed to the thread that waits for it
            future.set_exception(exc)
            return
        finally:
            beating.stop()
        choice.seconds = time.perf_counter() - started
        future.set_result(choice)
        ckpt = choice.found
        if ckpt is not None and ckpt.checked != "checksums" and ckpt.mode == "vanilla":
            for name in ckpt.manifest["files"]:
                read_through(ckpt.path / name)

    threading.Thread(target=work, name="pyrecover-choose", daemon=True).start()
    return future


def rank0_choice(chosen: Future | None, root: Path, below: int | None,
                 on_event: Callable[..., Any], report_invalid: Callable[[int, Path, str], Any]
                 ) -> tuple[Checkpoint | None, Any, dict[str, float], BaseException | None]:
    """rank0_choice is rank 0's part of a resume's choice (`chosen`, the pick begun in the
    background, or a pick now): (the checkpoint, what rank 0 broadcasts, where the choice's
    seconds went, the error to raise once the others know). It broadcasts the folder, None
    (start fresh), {"refused": why} (nothing could be read) or {"failed": why}: the choice
    itself failed (a checkpoints folder this user may not read) and every rank ends, instead
    of the others waiting for a rank 0 that is gone."""
    asked = time.perf_counter()
    try:
        picked = chosen.result() if chosen is not None else choose(root, below, on_event)
    except Exception as exc:
        return None, {"failed": f"{type(exc).__name__}: {exc}"}, {}, exc
    times = {"wait_s": round(time.perf_counter() - asked, 3)}  # the checkpoint_chosen phase
    if picked.seconds is not None:
        times["verify_s"] = round(picked.seconds, 3)
    for step, folder, problem in picked.invalid:
        report_invalid(step, folder, problem)
    refused = picked.refusal()  # none could be read: every rank ends, none starts over
    message = str(picked.found.path) if picked.found else {"refused": refused} if refused \
        else None
    return picked.found, message, times, None


def beats(root: Path) -> int:
    """beats is how many beats rank 0's choice has given under the checkpoints root `root`
    (0: none, or it is done): a waiting rank's sign of progress (train.py's watchdog)."""
    try:
        return os.stat(root / VERIFYING).st_size
    except OSError:
        return 0


def _progress() -> int:
    """_progress moves as rank 0's choice gets on: checksum reads, and a killed save's files
    removed by `tidy`."""
    return checksum.checksummed_bytes() + entries.removed_entries()


class _Beats:
    """_Beats appends one byte to `path` every `every` seconds from `start` until `stop`, which
    removes the file, but only where the checksum pass read something since the last look
    (`beat`): a timer alone would beat on while a read hangs, and hide the hang from every
    rank's watchdog. A beat that cannot be written (read-only or full storage) is skipped:
    the beats only keep the other ranks' watchdogs from firing too early."""

    def __init__(self, path: Path, every: float) -> None:
        self.path, self.every = path, every
        self._read = _progress()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="pyrecover-beats", daemon=True)

    def start(self) -> _Beats:
        self._thread.start()
        return self

    def beat(self) -> bool:
        """beat appends a byte if the checksum reads moved since its last call (or since this
        was made), and says whether they had. The timer's thread calls it every `every` s."""
        read = _progress()
        if read == self._read:
            return False
        self._read = read
        try:
            with open(self.path, "ab") as f:
                f.write(b".")
        except OSError:
            pass
        return True

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def _beat(self) -> None:
        while not self._done.wait(self.every):
            self.beat()


def resume_newest(manager: Any, accept: Callable[[Restored], Any],
                  on_chosen: Callable[[Checkpoint], Any], keep_weights: bool = True
                  ) -> tuple[Checkpoint, Restored] | None:
    """resume_newest is `CheckpointManager.resume` (see there); `manager` is that manager (not
    imported here: the manager imports this module)."""
    initial = None
    below: int | None = None  # rank 0's: the others only restore what it chose
    newest_failure = ""

    def every_rank(error: str) -> list[str]:
        errors = [error]
        if tdist.is_initialized() and manager.world_size > 1:
            errors = [""] * manager.world_size
            tdist.all_gather_object(errors, error)
        return errors

    while True:
        error, restored = "", None
        try:
            ckpt = manager.find_resume(below)
        except NotReadableHere as exc:  # not on rank 0: that one's pick is None at the end too
            ckpt, error = None, f"{exc}"
        else:
            if ckpt is None:
                break
            on_chosen(ckpt)
        # Every rank can read it before any restores it: DCP's load is collective, and its
        # ranks would wait there for one that went on to count the failures.
        errors = every_rank(error)
        if ckpt is not None and not any(errors):
            initial = initial or _copy_state(manager.parts, keep_weights)
            try:
                restored = manager.restore(ckpt)
                accept(restored)
            except (Exception, _dcp_exception()) as exc:  # DCP's is a BaseException
                error = f"{type(exc).__name__}: {first_line(exc)}"
            errors = every_rank(error)
        failed = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)
        if not failed:
            assert ckpt is not None and restored is not None
            manager.last_saved_step = ckpt.step  # committed already: finish() leaves it be
            return ckpt, restored
        if ckpt is not None:
            if manager.rank == 0:
                manager._report_invalid(ckpt.step, ckpt.path, f"cannot be restored ({failed})")
            newest_failure = newest_failure or f"step {ckpt.step} ({ckpt.path}): {failed}"
            below = ckpt.step
        newest_failure = newest_failure or failed
    if initial is not None:
        _load_state(manager.parts, initial)
    if newest_failure:
        raise ResumeFailed(
            f"no checkpoint could be restored; the newest, {newest_failure}. Every checkpoint "
            "is left in place and the run does not start over: run the same command again "
            "(a requeued job does) once the fault is fixed")
    return None


def _dcp_exception() -> type[BaseException]:
    """_dcp_exception is torch's wrapper of every rank's failure inside dcp.load (a
    BaseException), where DCP is loaded; a run that never imported DCP cannot raise it, and
    importing it here would cost every start a second (pyrecover imports DCP lazily)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return getattr(api, "CheckpointException", CheckpointError)


def _copy_state(parts: Parts, weights: bool) -> dict[str, Any]:
    """_copy_state is a CPU copy of the parts' state, taken before a restore is tried; without
    `weights` the model's are left out (a caller that initializes them where nothing loads:
    a copy of a large model's weights costs host memory and seconds)."""
    import copy

    return {"model": {k: v.detach().to("cpu", copy=True)
                      for k, v in parts.model.state_dict().items()} if weights else None,
            "optimizer": copy.deepcopy(parts.optimizer.state_dict()),
            "scheduler": copy.deepcopy(parts.scheduler.state_dict())}


def _load_state(parts: Parts, state: dict[str, Any]) -> None:
    if state["model"] is not None:
        parts.model.load_state_dict(state["model"])
    parts.optimizer.load_state_dict(state["optimizer"])
    parts.scheduler.load_state_dict(state["scheduler"])
