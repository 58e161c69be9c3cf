"""Staging: copy the live state into host buffers allocated once, off the training loop's path.

One path for every device, so what CPU CI runs is what a GPU runs:

- `Copier.start(targets, sources)` queues one `torch._foreach_copy_` from the live tensors
  into host buffers. On CUDA it runs on a side stream, after that stream has waited for the
  work the loop queued so far (so it copies the state as of now), into pinned buffers, and an
  event marks its end; a thread waits for the event. On CPU the copy itself runs in that
  thread. Either way the returned future resolves once the bytes are on the host, and then
  runs `then` (DCP's upload, memory mode's replica exchange).
- `Copier.fence()` is what the loop calls before the optimizer changes the state. On CUDA it
  makes the loop's stream wait for the copy's event: the host does not block, and the GPU
  waits only for what is not copied yet. On CPU it waits for the thread.
- `Copier.device_waits()` is how long the loop's stream stood still at those fences (timed
  by a pair of CUDA events around each wait, read once they completed), and when each wait
  ended on the host's clock (when the copy's thread saw the copy end): a wait the host may
  never see, which the loop's `blocked` figure must still count, once (stall.py).
- `Copier.allocate(fn)` runs `fn` in the copy's thread, outside the copy's bookkeeping, and
  `Copier.allocated()` waits for it: the buffers are allocated there before the first save
  (`StateStager.prepare`, memory mode's `prepare`). Pinned memory is slow to allocate (the
  pages are locked and mapped for the device): on an H200 VM, gpt-125m's two async saves
  (1.6 GB with AdamW) blocked the loop 1.56 s together while the first one allocated, 0.04 s
  once `prepare` did. torch lets go of the GIL while it allocates, so the loop goes on.
- `StateStager` stages a state dict for DCP mode on top of it: buffers kept per key (shape,
  dtype) from one save to the next, tied tensors copied once, the staged state dict made of
  plain tensors (no parameters, no subclasses; an FSDP shard, a DTensor, is staged as its
  local tensor wrapped in the same placement), anything that is not a tensor deep-copied.

torch's own `DefaultStager` did this job on CUDA until torch 2.11, where every save after the
first failed inside its deep copy (`KeyError: <class 'type'>`); nothing here depends on
torch's staging internals or on `dcp.async_save`, whose API changed between releases.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.tensor import DTensor

log = logging.getLogger("pyrecover")


def host_buffer(like: torch.Tensor | torch.Size | tuple, dtype: torch.dtype,
                device: torch.device, ahead: bool = False) -> torch.Tensor:
    """host_buffer is an empty CPU tensor to copy device state into: pinned when the state
    lives on CUDA, so the device-to-host copy is asynchronous and at full bandwidth.

    `ahead`: the buffer is allocated before its first copy (`Copier.allocate`), so its pages
    are made resident now. Pinned memory is resident once allocated; a plain CPU tensor's pages
    are only mapped at the first write, and that first copy ran 7x slower than the next ones
    (a 1 GB state on the 2-core VM: 0.83 s against 0.11 s), in the first save's blocked time."""
    shape = like.shape if isinstance(like, torch.Tensor) else like
    pinned = device.type == "cuda"
    if ahead and not pinned:
        return torch.zeros(shape, dtype=dtype)
    return torch.empty(shape, dtype=dtype, pin_memory=pinned)


def one_thread() -> None:
    """one_thread keeps the calling background thread (a copy's, a save's) out of OpenMP's
    thread teams. A torch op in a second thread gave it a team of its own; libgomp, with more
    of its threads than cores, then stops spin-waiting in every team, and the loop's small ops
    each paid a futex wake-up: on 2 cores the tiny model's steps took 35 ms instead of 13 in
    memory mode, with nothing blocked. The loop's thread keeps its own count (OpenMP's is per
    thread; torch's for threads started later becomes 1, which suits background ones)."""
    torch.set_num_threads(1)


class Copier:
    """Copier copies lists of tensors into host buffers, one batch at a time, in the background
    (module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        # On CUDA the thread waits on events of this device: make it the thread's current
        # device, or the wait would open a context (hundreds of MB) on GPU 0 for every rank.
        self._thread = ThreadPoolExecutor(
            1, thread_name_prefix="pyrecover-stage",
            initializer=torch.cuda.set_device if self.cuda else one_thread,
            initargs=(device,) if self.cuda else ())
        # CUDA: the end of the copy in flight, until fenced, with the list its thread puts
        # the host's time into once the copy ended.
        self._event: tuple[Any, list[float]] | None = None
        self._future: Future | None = None
        # CUDA: the events around each fence's wait, and its copy's end on the host's clock.
        self._fences: list[tuple[Any, Any, list[float]]] = []
        self._allocating: Future | None = None  # buffers being allocated ahead (allocate)

    def start(self, targets: list[torch.Tensor], sources: list[torch.Tensor],
              then: Callable[[], Any] | None = None, background: bool = True) -> Future:
        """start copies `sources` into `targets` and then calls `then` (in the copy's thread);
        the future holds what `then` returned. `background=False` (CPU only) copies in the
        caller's thread and calls `then` there, for copies too small to be worth a thread."""
        if self.cuda:
            assert self.stream is not None
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                self._copy(targets, sources)
                event = torch.cuda.Event()
                event.record(self.stream)
            landed: list[float] = []
            self._event = (event, landed)

            def land(keep: list[torch.Tensor] = sources) -> Any:
                # `keep` holds the sources until the side stream has read them: a temporary
                # (a state dict's fresh tensor) freed earlier could be reallocated by the
                # loop's stream under the copy.
                event.synchronize()
                landed.append(time.perf_counter())  # a fence on this copy ended about now
                del keep
                return then() if then is not None else None
            job = land
        else:
            def job() -> Any:
                self._copy(targets, sources)
                return then() if then is not None else None
        if background or self.cuda:
            self._future = self._thread.submit(job)
        else:
            self._future = Future()
            try:
                self._future.set_result(job())
            except BaseException as exc:  # reported through the future, like a thread's
                self._future.set_exception(exc)
        return self._future

    def allocate(self, fn: Callable[[], Any]) -> None:
        """allocate runs `fn` (which allocates buffers) in the copy's thread, before any copy
        started after it; `allocated` waits for it (`fence` and `wait` do not)."""
        self.allocated()
        self._allocating = self._thread.submit(fn)

    def allocated(self) -> None:
        """allocated returns once the buffers `allocate` asked for are there. A failure is
        only logged: whoever needs a missing buffer allocates it itself."""
        allocating, self._allocating = self._allocating, None
        failed = None if allocating is None else allocating.exception()
        if failed is not None:
            log.debug("host buffers could not be allocated ahead: %s", failed)

    def _copy(self, targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
        # One dispatch for every tensor on CPU (a copy_ call each cost 4 us apiece); across
        # devices torch takes its slow path, one asynchronous copy_ per tensor.
        if targets:
            torch._foreach_copy_(targets, sources, non_blocking=self.cuda)

    def fence(self) -> None:
        """fence returns once the state may change without reaching the copy in flight
        (CUDA: the loop's stream waits for it, the host does not; CPU: the copy is done).
        A failed copy is not raised here: whoever reads the result (`wait`) reports it."""
        if self.cuda:
            copied, self._event = self._event, None
            if copied is not None:
                event, landed = copied
                stream = torch.cuda.current_stream(self.device)
                before = torch.cuda.Event(enable_timing=True)
                after = torch.cuda.Event(enable_timing=True)
                before.record(stream)
                stream.wait_event(event)
                after.record(stream)
                self._fences.append((before, after, landed))
            return
        future = self._future
        if future is not None:
            future.exception()  # waits; the error stays in the future

    def device_waits(self, drain: bool = False) -> list[tuple[float, float]]:
        """device_waits are the loop's stream's waits at fences that are over and were not
        returned before, each (seconds, when its copy ended on `time.perf_counter`'s clock);
        none on CPU, where `fence` blocks the host instead. `drain` waits for the fences
        still pending."""
        waits, pending = [], []
        for before, after, landed in self._fences:
            if drain:
                after.synchronize()
            if after.query():  # (the copy's thread may not have noted its end yet: now)
                ended = landed[0] if landed else time.perf_counter()
                waits.append((before.elapsed_time(after) / 1e3, ended))
            else:
                pending.append((before, after, landed))
        self._fences = pending
        return waits

    def wait(self, timeout: float | None = None) -> Any:
        """wait returns what the copy in flight's `then` returned once the bytes are on the
        host, or raises its error; None when nothing is in flight. After `timeout` seconds it
        raises TimeoutError and the copy stays in flight: on CUDA a copy queued behind a
        collective that never completes (a peer died in it) never lands."""
        future = self._future
        if future is None:
            return None
        try:
            return future.result(timeout)
        finally:
            if future.done():
                self._future = None

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.allocated()


class StateStager:
    """StateStager stages a state dict for an asynchronous DCP save through a `Copier`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.copier = Copier(device)
        self._buffers: dict[tuple, torch.Tensor] = {}

    def prepare(self, state_dict: dict[str, Any]) -> None:
        """prepare allocates, in the copy's thread, the buffers a save of `state_dict` will
        need, so the first save does not allocate them in the loop's time."""
        self.copier.allocated()
        wanted: dict[tuple, tuple[torch.Size, torch.dtype]] = {}

        def want(key: tuple, value: torch.Tensor) -> torch.Tensor:
            wanted[key] = (value.shape, value.dtype)
            return value

        self._walk(state_dict, want)

        def allocate() -> None:
            for key, (shape, dtype) in wanted.items():
                buf = self._buffers.get(key)
                if buf is None or buf.shape != shape or buf.dtype != dtype:
                    self._buffers[key] = host_buffer(shape, dtype, self.device, ahead=True)
        self.copier.allocate(allocate)

    def stage(self, state_dict: dict[str, Any], **_: Any) -> Future:
        staged, targets, sources = self.place(state_dict)
        return self.copier.start(targets, sources, then=lambda: staged)

    def place(self, state_dict: dict[str, Any]
              ) -> tuple[dict[str, Any], list[torch.Tensor], list[torch.Tensor]]:
        """place maps `state_dict` onto the kept buffers: the staged dict (buffers where the
        tensors were) and the lists of copies to make."""
        self.copier.allocated()
        sources: list[torch.Tensor] = []
        targets: list[torch.Tensor] = []

        def buffer(key: tuple, value: torch.Tensor) -> torch.Tensor:
            buf = self._buffers.get(key)
            if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
                buf = host_buffer(value, value.dtype, self.device)
                self._buffers[key] = buf
            sources.append(value.detach())
            targets.append(buf)
            return buf

        return self._walk(state_dict, buffer), targets, sources

    @staticmethod
    def _walk(state_dict: dict[str, Any],
              tensor: Callable[[tuple, torch.Tensor], torch.Tensor]) -> dict[str, Any]:
        """_walk copies the structure of `state_dict`, each distinct tensor replaced by what
        `tensor(key, value)` returns (a tensor met twice, tied weights, is asked once), and
        anything else deep-copied."""
        seen: dict[tuple, torch.Tensor] = {}

        def put(value: Any, key: tuple) -> Any:
            if isinstance(value, DTensor):
                # FSDP: stage this rank's own shard and describe it as the same DTensor, so DCP
                # writes the shard at its place in the whole tensor (nothing is gathered).
                # (The constructor, not from_local, which would move a host buffer back to
                # the mesh's device.)
                return DTensor(put(value.to_local(), key), value._spec, requires_grad=False)
            if isinstance(value, torch.Tensor):
                same = (value.device, value.data_ptr(), value.dtype, tuple(value.shape),
                        value.stride())
                if same not in seen:
                    seen[same] = tensor(key, value)
                return seen[same]
            if isinstance(value, dict):
                return {k: put(v, (*key, k)) for k, v in value.items()}
            if isinstance(value, (list, tuple)):
                items = [put(v, (*key, i)) for i, v in enumerate(value)]
                return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
            return copy.deepcopy(value)

        return put(state_dict, ())

    def fence(self) -> None:
        self.copier.fence()

    def close(self) -> None:
        self.copier.close()
        self._buffers.clear()
