"""DCP mode: `torch.distributed.checkpoint`, written by all ranks, in the background.

Layout of a step folder: DCP's own files (`.metadata`, `__<rank>_<n>.distcp`) holding the
model and optimizer under the keys `model.<fqn>` and `optim.<...>`, so plain
`torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id=folder)` reads
the weights without pyrecover; plus `extra.json` (scheduler, config) and `rng-<rank>.pt`.

With DDP every rank holds every tensor; each rank stages and writes only its share
(share.py: each tensor to the least loaded rank by bytes, decided from the shapes before
anything is copied), so writes spread over all ranks and each rank's host buffers hold 1/N
of the state. With sharded (DTensor) state each rank writes its own shards.

An asynchronous save copies the state into host buffers that are allocated once and reused
(pinned on CUDA; staging.py, the same code on every device), on a side stream (CUDA) or in a
thread (CPU), while the loop goes on with the next step's forward and backward; the loop is
fenced only when the optimizer is about to change the state (`wait_staged`). Planning,
writing and fsync then run in a background thread over a dedicated gloo process group, so
they never interleave with the training's own collectives; files are checksummed while
written (dcp_io.py). The manager commits once every rank has reported its files durable.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from pyrecover import faults
from pyrecover.checkpoint import dcp_io, rng, share
from pyrecover.checkpoint.live import LiveStateDict
from pyrecover.checkpoint.mode import (
    Restored,
    TrainArg,
    WriteResult,
    train_now,
    train_state_problem,
)
from pyrecover.checkpoint.staging import StateStager
from pyrecover.checkpoint.store import Checkpoint, Pending, sha256_file

NAME = "dcp"
EXTRA_FILE = "extra.json"


def rng_file(rank: int) -> str:
    return f"rng-{rank}.pt"


def write_rng(path, state: dict[str, Any] | None = None) -> None:
    """write_rng saves this process's RNG states (or `state`, a rank's that `convert` read) to
    `path` (fsynced when the save ends). It is serialized in memory first: a failed write (a
    full disk) then raises the OSError, where torch.save to a path raises an error naming only
    its zip writer's offsets."""
    data = io.BytesIO()
    torch.save(rng.capture() if state is None else state, data)
    with open(path, "wb") as f:
        f.write(data.getbuffer())


def _extra(ckpt: Checkpoint) -> dict[str, Any]:
    return json.loads((ckpt.path / EXTRA_FILE).read_text())


def own_files(written: list[str], rank: int) -> list[str]:
    """own_files lists what `rank` was expected to write into a DCP step folder: the data
    files its writer wrote, its RNG file, and on rank 0 `.metadata` and `extra.json`. Each
    must be there when the save is committed: one that went missing fails the save."""
    names = [*written, rng_file(rank)]
    if rank == 0:
        names += [".metadata", EXTRA_FILE]
    return sorted(set(names))


@contextlib.contextmanager
def quiet_single_process():
    """quiet_single_process hides DCP's warning that it runs without a process group (on
    purpose, in a one-process run or a tool)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class StartFailed(Exception):
    """StartFailed is this rank's save failing as it started; its message is that error's
    description."""


def describe(exc: BaseException) -> str:
    """describe is one line for a failed save: DCP wraps each rank's error, with its
    traceback, in a CheckpointException; the errors themselves are what a person needs."""
    if isinstance(exc, StartFailed):
        return str(exc)
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        parts = {f"{type(e).__name__}: {e}" for e, _ in failures.values()}
        return "; ".join(sorted(parts))
    return f"{type(exc).__name__}: {exc}"


class DcpMode:
    name = NAME
    asynchronous = True

    def __init__(self, rank: int, world_size: int, device: torch.device,
                 async_save: bool = True) -> None:
        self.rank, self.world_size = rank, world_size
        self.asynchronous = async_save
        # Checkpoint collectives run in a background thread: give them their own group so they
        # never interleave with the training's all-reduces on the default one.
        self.group = tdist.new_group(backend="gloo") if tdist.is_initialized() else None
        # The copy into reused host buffers runs in the background (a side stream on CUDA,
        # a thread on CPU): the loop goes on with the next step's forward and backward, and
        # is fenced only when the optimizer is about to change the state (`wait_staged`,
        # via before_update).
        self.stager = StateStager(device)
        self._staged = False  # a save in flight may still be reading the live state
        self._live = LiveStateDict()  # get_state_dict, asked again only when the tensors change
        self._thread: threading.Thread | None = None
        self._result: WriteResult | None = None

    def start(self, pending: Pending, parts, train: TrainArg) -> None:
        """start begins this rank's share of the save at `pending`; with `async_save` it
        returns once the copy is started, and `result` says when the write is durable.

        A failure here (the RNG file on a full disk) is this rank's result, as a failed write
        in the save's thread is: the thread still takes part in DCP's collectives, with
        nothing to write, so every rank learns of it at the commit and discards the save.
        """
        folder = pending.tmp
        writer = dcp_io.Writer(folder)
        extra = None
        try:
            write_rng(folder / rng_file(self.rank))
            # Rank 0's extra.json is written by the save's thread (`_finish`): the train state
            # may be a function that waits for the step's numbers (manager._start), so only
            # there; the scheduler's state and the config are copied now, as at this step.
            extra = (copy.deepcopy({"scheduler": parts.scheduler.state_dict(),
                                    "config": parts.config}) if self.rank == 0 else None)
            state = self._state(parts)
            if self.asynchronous:
                # What dcp.async_save does, without its API, which changed between torch
                # releases (2.7 has no async_stager): the copy starts now, the save runs in
                # our thread.
                staged = self.stager.stage(state)
                self._staged = True

                def upload() -> None:
                    self._save(staged.result(), writer)
            else:
                def upload() -> None:
                    self._save(state, writer)
        except OSError as exc:
            # Only its description: `upload` holding the error itself made a cycle (error ->
            # traceback -> upload's frame -> error) that kept this mode, its process group
            # and the state alive past the group's teardown, until a collection during the
            # interpreter's shutdown, where freeing gloo's work aborted a rank now and then.
            failed = describe(exc)

            def upload() -> None:
                # DCP's collectives, with nothing to write; an error of theirs (another rank
                # failed too) says less than this rank's own.
                with contextlib.suppress(BaseException):
                    self._save({}, writer)
                raise StartFailed(failed)
        self._result = None
        self._thread = threading.Thread(target=self._finish,
                                        args=(upload, writer, pending, extra, train),
                                        name="pyrecover-dcp-save", daemon=True)
        self._thread.start()
        if not self.asynchronous:
            self._thread.join()

    def _state(self, parts) -> dict[str, Any]:
        """_state is what this rank saves: the live model and optimizer state dicts, or only
        its share of them where every rank holds the same (DDP)."""
        model_sd, optim_sd = self._live.get(parts.model, parts.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if share.replicated(state):  # DDP: stage and write only this rank's share
            state = share.own_share(state, self.rank, self.world_size)
        return state

    def prepare(self, parts) -> None:
        """prepare allocates the staging buffers of an asynchronous save in the background."""
        if self.asynchronous:
            self.stager.prepare(self._state(parts))

    def wait_staged(self) -> None:
        """wait_staged returns once the state may change without reaching the save in flight
        (on CUDA the device waits for the copy, the host does not; a failed copy is reported
        by the save's own result)."""
        if self._staged:
            self._staged = False
            self.stager.fence()

    def device_waits(self, drain: bool = False) -> list[tuple[float, float]]:
        return self.stager.copier.device_waits(drain)

    def _save(self, state: dict[str, Any], writer: dcp_io.Writer) -> None:
        """_save plans and writes `state` with DCP over the checkpoint group (collective)."""
        with quiet_single_process():
            dcp.save(state, storage_writer=writer, process_group=self.group,
                     no_dist=self.group is None)

    def _finish(self, upload: Callable[[], None], writer: dcp_io.Writer, pending: Pending,
                extra: dict[str, Any] | None, train: TrainArg) -> None:
        folder = pending.tmp
        try:
            faults.maybe_kill(pending.step, self.rank, point="save")
            upload()
            if extra is not None:  # after the copy, which the device ran after the step
                (folder / EXTRA_FILE).write_text(json.dumps({**extra, "train": train_now(train)}))
            files = {}
            for name in own_files(list(writer.entries), self.rank):
                path = folder / name
                if not path.is_file():
                    raise FileNotFoundError(f"{path} is missing (removed by another process?)")
                if name in writer.entries:  # checksummed and fsynced while written
                    files[name] = writer.entries[name]
                    continue
                with path.open("rb") as f:
                    os.fsync(f.fileno())
                files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
            self._result = WriteResult(files)
        # DCP's CheckpointException is a BaseException: catch it too, or the manager would only
        # learn that the write ended without a result.
        except BaseException as exc:  # reported to the manager, which discards the whole save
            self._result = WriteResult({}, describe(exc))

    def result(self, wait: bool) -> WriteResult | None:
        """result is (files, error) once this rank's write is durable and hashed, else None.

        Asking again returns the same answer until the next `start`, because the manager
        commits only when every rank has answered.
        """
        if self._thread is None:
            return None
        if wait:
            self._thread.join()
        return None if self._thread.is_alive() else self._result

    def restore(self, ckpt: Checkpoint, parts) -> Restored:
        model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        with quiet_single_process():
            dcp.load(state, storage_reader=dcp_io.Reader(ckpt.path),
                     process_group=self.group, no_dist=self.group is None)
        set_state_dict(parts.model, parts.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        parts.scheduler.load_state_dict(_extra(ckpt)["scheduler"])
        mine = ckpt.path / rng_file(self.rank)
        saved_rng = torch.load(mine, weights_only=True) if (
            self.rank < ckpt.manifest["world_size"] and mine.is_file()) else None
        if saved_rng is not None:
            rng.check(saved_rng, self.rank)  # before train.py applies it (rng.check)
        return Restored(train=dict(ckpt.manifest["train_state"]), rng=saved_rng)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.stager.close()


# --------------------------------------------- offline: `pyrecover ckpt` (mode.Offline, Writer)

def check_readable(ckpt: Checkpoint) -> None:
    if problem := train_state_problem(ckpt.manifest["train_state"]):  # what a restore hands on
        raise ValueError(problem)
    dcp_io.Reader(ckpt.path)  # DCP's metadata, through the restricted unpickler
    _extra(ckpt)["config"]["model"]
    missing = [rng_file(r) for r in range(int(ckpt.manifest["world_size"]))
               if not (ckpt.path / rng_file(r)).is_file()]  # present only: not read
    if missing:
        raise FileNotFoundError(f"no {', '.join(missing[:3])}"
                                f"{f' (and {len(missing) - 3} more)' if len(missing) > 3 else ''}"
                                f" in {ckpt.path}: the RNG files of its world size")
    for r in range(int(ckpt.manifest["world_size"])):  # about 10 KB each: what a resume takes
        rng.check(torch.load(ckpt.path / rng_file(r), weights_only=True))


def read_config(ckpt: Checkpoint) -> dict[str, Any]:
    return _extra(ckpt)["config"]


def read_model(ckpt: Checkpoint, build_model) -> dict[str, torch.Tensor]:
    state = {"model": build_model(read_config(ckpt)["model"]).state_dict()}
    with quiet_single_process():
        dcp.load(state, storage_reader=dcp_io.Reader(ckpt.path), no_dist=True)
    return state["model"]


def read_all(ckpt: Checkpoint, parts) -> list[dict[str, Any]]:
    DcpMode(0, 1, torch.device("cpu"), async_save=False).restore(ckpt, parts)
    rngs = [torch.load(ckpt.path / rng_file(r), weights_only=True)
            for r in range(int(ckpt.manifest["world_size"]))]
    for rank, state in enumerate(rngs):
        rng.check(state, rank)
    return rngs


def write_all(out, parts, train: dict[str, Any], rngs: list[dict[str, Any]]) -> None:
    """write_all writes a folder plain `torch.distributed.checkpoint.load` reads (`model.*`,
    `optim.*`), with `extra.json` and `rng-<rank>.pt` as a step's folder has them."""
    out.mkdir(parents=True)
    model_sd, optim_sd = get_state_dict(parts.model, parts.optimizer)
    with quiet_single_process():
        dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=dcp_io.Writer(out),
                 no_dist=True)
    extra = {"scheduler": parts.scheduler.state_dict(), "config": parts.config, "train": train}
    (out / EXTRA_FILE).write_text(json.dumps(extra))
    for rank, state in enumerate(rngs):
        write_rng(out / rng_file(rank), state)
