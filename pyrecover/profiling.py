"""Profile a window of training steps: `train.profile: "A-B"` (steps A to B, counted as the
run counts them; "A" alone is one step; empty, the default, profiles nothing).

`torch.profiler` records the steps of that window on every rank: the CPU's operators and, on
a GPU, every kernel and copy with its stream. Each rank writes
`<run>/profile/steps-A-B-rank-R.trace.json.gz` (open it in https://ui.perfetto.dev or
chrome://tracing) and a table of its operators beside it (`...-rank-R.txt`); rank 0 says per
step, in its log and in a `profile` event:

- `wall_s`: host time per step, from the end of step A-1 (its update queued and logged, the
  device synchronized) to the end of step B (synchronized); so each step's time holds the
  checkpoint or snapshot taken after the step before it,
- `kernels_s`: time the device spent in kernels (the union of their intervals: two kernels at
  once on two streams count once; a collective's kernel counts while it waits for a peer),
- `to_host_s` / `to_device_s`: copies from and to the device (a snapshot's or an asynchronous
  save's copy is `to_host_s`),
- `idle_s`: wall time with no kernel running, where the device waited for the host or at a
  checkpoint's fence: kernels that got slower show in `kernels_s`, such waits in `idle_s`.

On a CPU there is no device: only `wall_s` and the operator table. The profiler slows the
steps it records (the operators' bookkeeping), so do not read throughput from them;
`pyrecover bench train --profile N` profiles N steps after its measured ones. `pyrecover
status` shows the newest profile (torch is imported only where a profile starts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pyrecover.preempt import StopRequested

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pyrecover")


class StepProfiler:
    """StepProfiler records the window's steps (module docstring). Entered (`with`), it starts
    where the run resumes just before the window; `after_step(step)` is called once a step's
    update is queued and its log line written; leaving ends a window the run left early (the
    last step, a stop). `phase` is the hang watchdog's: writing a trace is no hang."""

    def __init__(self, window: tuple[int, int] | None, folder: Path, rank: int,
                 device: torch.device, done: int, event: Callable[..., Any] | None = None,
                 phase: Callable[[str], Any] | None = None):
        self.window, self.folder, self.rank, self.device = window, folder, rank, device
        self.event = event  # rank 0's run.event; None elsewhere
        self.phase = phase
        self._prof: Any = None
        self._began = (0, 0.0)  # (the first step recorded, perf_counter then)
        self._done = done  # the last step done
        self.summary: dict[str, Any] | None = None

    def after_step(self, step: int) -> None:
        self._done = step
        if self.window is None or self.summary is not None:
            return
        first, last = self.window
        if self._prof is None and first - 1 <= step < last:
            self._start(step + 1)
        elif self._prof is not None and step >= last:
            self._stop(step)

    def __enter__(self) -> StepProfiler:
        self.after_step(self._done)
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if self._prof is None:
            return
        if kind is not None and not issubclass(kind, StopRequested):
            # A failed run: a device that hangs would hang the profiler's flush too.
            log.warning("profile of steps %d-%d not written: the run failed", self._began[0],
                        self._done)
            return
        self._stop(self._done)  # the run ended (or stopped) inside the window

    def _start(self, first: int) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)  # the step before is not in the window
        self._prof = profile(activities=activities)
        self._prof.start()
        self._began = (first, time.perf_counter())

    def _stop(self, last: int) -> None:
        """_stop ends the recording and writes it; a write that fails (a full disk) is a
        warning, never the run's end."""
        import torch

        if self.phase is not None:  # (the loop's next phase ends it)
            self.phase("idle")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self._began[1]
        prof, self._prof = self._prof, None
        first = self._began[0]
        try:
            prof.stop()
            if last < first:  # stopped before the window's first step: nothing to say
                self.summary = {}
                return
            self.summary = self._write(prof, first, last, wall)
        except Exception as error:
            self.summary = {}
            log.warning("profile of steps %d-%d not written: %s: %s", first, last,
                        type(error).__name__, error)
            return
        if self.rank == 0:
            log.info("profile of steps %d-%d, per step: %s; trace %s", first, last,
                     describe(self.summary), self.summary["trace"])
            if self.event is not None:
                self.event("profile", **self.summary)

    def _write(self, prof: Any, first: int, last: int, wall: float) -> dict[str, Any]:
        steps = last - first + 1
        self.folder.mkdir(parents=True, exist_ok=True)
        stem = self.folder / f"steps-{first}-{last}-rank-{self.rank}"
        trace = stem.with_name(stem.name + ".trace.json.gz")
        prof.export_chrome_trace(str(trace))
        sort = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=40)
        stem.with_name(stem.name + ".txt").write_text(table + "\n")
        return {"first": first, "last": last, "steps": steps,
                **per_step(device_times(prof.events()), wall, steps), "trace": str(trace)}


# CUPTI's synchronization records (torch records them only with
# `_ExperimentalConfig(enable_cuda_sync_events=True)`): a stream waiting is not a kernel.
SYNC_KINDS = frozenset({"Stream Sync", "Event Sync", "Context Sync", "Stream Wait Event",
                        "Unknown Sync"})


def device_times(events: Any) -> dict[str, float]:
    """device_times sums the device's activities among a profile's events, in seconds:
    kernels (the union of their intervals), copies to the host and to the device (each
    summed). The CPU's operators are left out (their device times repeat their kernels')."""
    kernels: list[tuple[float, float]] = []
    to_host = to_device = 0.0
    for e in events:
        if getattr(e, "device_type", None) is None or e.device_type.name == "CPU":
            continue
        if getattr(e, "is_user_annotation", False):  # a span of kernels (an optimizer step,
            continue  # a compiled region, a collective), gaps included: not a kernel
        if e.name in SYNC_KINDS:  # a stream waiting, recorded where a profile asks for it
            continue
        start, end = e.time_range.start, e.time_range.end
        name = e.name
        if name.startswith("Memcpy DtoH"):
            to_host += end - start
        elif name.startswith("Memcpy HtoD"):
            to_device += end - start
        elif not name.startswith(("Memcpy", "Memset")):
            kernels.append((start, end))
    return {"kernels": union(kernels) / 1e6, "to_host": to_host / 1e6,
            "to_device": to_device / 1e6, "device_events": float(len(kernels))}


def union(intervals: list[tuple[float, float]]) -> float:
    """union is the length of the union of `intervals`."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def per_step(times: dict[str, float], wall: float, steps: int) -> dict[str, Any]:
    """per_step divides a window's times by its steps; no device (no kernel): wall only."""
    out: dict[str, Any] = {"wall_s": round(wall / steps, 6)}
    if times["device_events"]:
        out.update({"kernels_s": round(times["kernels"] / steps, 6),
                    "idle_s": round(max(0.0, wall - times["kernels"]) / steps, 6),
                    "to_host_s": round(times["to_host"] / steps, 6),
                    "to_device_s": round(times["to_device"] / steps, 6)})
    return out


def describe(summary: dict[str, Any]) -> str:
    names = (("wall_s", "wall"), ("kernels_s", "kernels"), ("idle_s", "device idle"),
             ("to_host_s", "copies to host"), ("to_device_s", "copies to device"))
    return ", ".join(f"{label} {summary[k] * 1e3:.1f} ms" for k, label in names if k in summary)
