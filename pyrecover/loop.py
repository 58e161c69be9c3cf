"""The training loop: one optimizer step at a time, asking the checkpoint manager at each boundary.

It takes every collaborator as an argument (model, optimizer, data, manager, run directory),
so tests and other commands can drive it with real parts of any size.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as tdist

from pyrecover import faults, flops, optim, parallel
from pyrecover.checkpoint import CheckpointManager
from pyrecover.config import Config
from pyrecover.data import Batches
from pyrecover.oneline import said_once
from pyrecover.preempt import Stopper, StopRequested
from pyrecover.progress import Progress
from pyrecover.rundir import RunDir
from pyrecover.straggler import StragglerWatch
from pyrecover.straggler import report as report_stragglers
from pyrecover.tracking import Tracker
from pyrecover.watchdog import Watchdog

log = logging.getLogger("pyrecover")


class TrainingError(RuntimeError):
    """Training cannot go on (for example, too many consecutive non-finite steps)."""


@dataclass
class Outcome:
    """One step's loss and gradient norm on their way to the host: copied behind the loop
    (pinned memory and an event on CUDA), so the host need not wait for the device to queue
    the next step; `read` waits for this step's numbers only."""

    step: int
    values: torch.Tensor  # [loss, grad_norm] on the CPU
    ready: torch.cuda.Event | None = None

    @classmethod
    def of(cls, step: int, both: torch.Tensor) -> Outcome:
        if both.device.type != "cuda":
            return cls(step, both)
        host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)  # torch's host cache
        host.copy_(both, non_blocking=True)  # ordered after the step on its stream
        ready = torch.cuda.Event()
        ready.record()
        return cls(step, host, ready)

    def read(self) -> tuple[float, float]:
        if self.ready is not None:
            self.ready.synchronize()
        loss, norm = self.values.tolist()
        return loss, norm


def bad_steps_after(bad_steps: int, loss: float, grad_norm: float) -> int:
    """bad_steps_after is the count of non-finite steps in a row once a step with these
    numbers is counted: 0 after a finite one."""
    return 0 if math.isfinite(loss) and math.isfinite(grad_norm) else bad_steps + 1


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps completed."""
    tokens_seen: int = 0
    data_position: int = 0
    """Windows of the global data stream consumed by all ranks together."""
    bad_steps: int = 0
    """Consecutive steps skipped for a non-finite loss or gradient."""

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class Loop:
    cfg: Config
    model: torch.nn.Module  # DDP-wrapped when world size > 1, or sharded by FSDP2 (parallel.py)
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    batches: Batches
    manager: CheckpointManager
    run: RunDir
    rank: int
    world_size: int
    device: torch.device
    state: TrainState
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    tracker: Tracker = field(default_factory=Tracker)  # wandb on rank 0; a no-op elsewhere
    stopper: Stopper | None = None  # signals and deadline; None: run to max_steps
    progress: Progress | None = None  # a bar on rank 0's terminal; None in a batch log
    flops_per_token: float = 0.0  # for MFU (flops.py)
    peak_flops: float | None = None  # one device's bf16 peak; None: no MFU (CPU, unknown GPU)
    # Hang watchdog and straggler detection (issue 14): phases are reported through _phase.
    watchdog: Watchdog = field(default_factory=Watchdog)  # unstarted: keeps time only
    stragglers: StragglerWatch | None = None
    on_step: Callable[[int], None] | None = None  # after each step's update and log line
    pending: Outcome | None = None  # the last step, until its numbers are read (settle)
    last: tuple[float, float] = (math.nan, math.nan)  # the newest loss and norm read

    def __post_init__(self) -> None:
        # FSDP's sharded parameters: the host reads each step before its update, as before.
        sharded = parallel.is_sharded(self.model)
        self.skip_on_device = optim.skips_on_device(self.optimizer) and not sharded
        # FSDP all-gathers in the forward and all-reduces the norm in the optimizer phase: a
        # rank there may be waiting for a peer, so those phases get names of their own (the
        # watchdog's and the job script's own-phase rules never blame such a rank's node).
        self.phase_names = {"forward": "fsdp_forward", "optimizer": "fsdp_optimizer"} if (
            sharded) else {}

    def run_steps(self) -> TrainState:
        t = self.cfg.train
        tokens_per_step = t.global_batch_size * self.cfg.model.block_size
        window_start, window_steps = time.perf_counter(), 0
        first = True
        while self.state.step < t.max_steps:
            step_started = time.perf_counter()
            outcome = self.one_step()
            # The step before this one is read now, while the device runs this one: no wait.
            self.settle()
            self.pending = outcome
            step = self.state.step + 1
            if first or step % t.log_interval == 0 or step == t.max_steps:
                self.settle()  # the first step's time, and the logged loss, are the device's
            first = False
            self.check_bad_steps()
            loss, grad_norm = self.last
            faults.maybe_delay()
            _, own_s = self.watchdog.step_done()  # issue 14: step time for the hang limit
            self.state.step += 1
            self.state.tokens_seen += tokens_per_step
            self.state.data_position = self.batches.position
            window_steps += 1
            step = self.state.step
            if self.progress is not None:
                self.progress.update(step, loss, tokens_per_step)
            if self.rank == 0 and (step % t.log_interval == 0 or step == t.max_steps):
                elapsed = time.perf_counter() - window_start
                self._log(step, loss, grad_norm, tokens_per_step * window_steps / elapsed,
                          elapsed / window_steps)
                window_start, window_steps = time.perf_counter(), 0
            if self.on_step is not None:  # (after the log: a profile's start is no logged step's)
                self.on_step(step)
            self._phase("checkpoint")
            self.manager.at_step(step, final=step == t.max_steps)
            self.check_bad_steps()  # a save there read this step: no checkpoint goes past it
            self._phase("sync")
            if self.stragglers is not None:  # issue 14: one all-gather every N steps
                found = self.stragglers.after_step(step, own_s)
                if self.rank == 0:
                    report_stragglers(found, self.run.event)
            if self.stopper is not None:
                self.stopper.deadline.observe(time.perf_counter() - step_started,
                                              self.manager.last_save_seconds)
                reason = self.stopper.check()
                if reason is not None and step < t.max_steps:
                    stall = self.manager.stall_seconds  # the training's, for the ledger
                    self.settle()  # a stop checkpoint never holds a run the guard has ended
                    self.check_bad_steps()
                    self._phase("checkpoint")
                    self.manager.finish(step)  # the stop checkpoint, committed before exit
                    raise StopRequested(step, reason, stall)
            self.tracker.after_step(step)
            faults.maybe_kill(step, self.rank, commit=self.manager.commit_inflight)
            faults.maybe_kill_on_file(self.rank, self.world_size)
        self.settle()
        self.check_bad_steps()
        if self.progress is not None:
            self.progress.close()
        return self.state

    def one_step(self) -> Outcome | None:
        """one_step queues one optimizer step. A step whose loss or gradient norm is not finite
        changes nothing but the schedule: with a fused optimizer the device skips the update
        itself (`found_inf`) and the host reads the step later (the Outcome returned, for
        `settle`); otherwise the host reads both numbers first, skips the update, and returns
        None (nothing left to read)."""
        t = self.cfg.train
        self._phase("data", self.state.step + 1)
        micro = self.batches.next_global(t.global_batch_size, self.rank, self.world_size,
                                         t.micro_batch_size)
        self.model.train()
        total = torch.zeros((), device=self.device)
        for i, (x, y) in enumerate(micro):
            self._phase("forward")
            faults.maybe_slow(self.rank)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            last = i == len(micro) - 1
            # Gradients are averaged across ranks only on the last micro-step.
            with parallel.grad_sync(self.model, last or self.world_size == 1):
                with self.autocast():
                    _, loss = self.model(x, y)
                loss = faults.maybe_nan(loss, self.state.step + 1)
                self._phase("backward")
                (loss / len(micro)).backward()
            total += loss.detach().float()
        total /= len(micro)
        self._phase("allreduce")
        if self.world_size > 1:
            tdist.all_reduce(total)
            total /= self.world_size
        self._phase("optimizer")
        max_norm = t.grad_clip if t.grad_clip > 0 else float("inf")
        grad_norm = parallel.clip_grad_norm(self.model, max_norm)
        both = torch.stack([total, grad_norm.float()])  # one copy to the host for the two
        outcome = Outcome.of(self.state.step + 1, both)
        if self.skip_on_device or self._settle(outcome):
            # The state is about to change: a background save must have finished copying it
            # (on CUDA the update waits on the device; the host goes on).
            self.manager.before_update()
            if self.skip_on_device:
                bad = ~torch.isfinite(both).all()
                self.optimizer.found_inf = bad.float()  # type: ignore[attr-defined]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.found_inf = None  # type: ignore[attr-defined]
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return outcome if self.skip_on_device else None

    def settle(self) -> None:
        """settle reads the step still on its way from the device, if any, and counts it."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self._settle(pending)

    def _settle(self, outcome: Outcome) -> bool:
        """_settle takes in a step's numbers; False for a non-finite step (skipped).

        On CUDA the read waits for the device, in phase `device`: a collective is only queued
        there, so a rank whose peer is stuck waits here, not in `allreduce`, and the job
        script must not take that wait for this rank's own hang (it blames `optimizer`)."""
        if outcome.ready is None:
            loss, norm = self.last = outcome.read()
        else:
            was = self.watchdog.current
            self._phase("device")
            loss, norm = self.last = outcome.read()
            self._phase(was)
        self.state.bad_steps = bad_steps_after(self.state.bad_steps, loss, norm)
        if not self.state.bad_steps:
            return True
        if self.rank == 0:
            log.warning("step %d: non-finite loss %s or gradient norm %s; update skipped "
                        "(%d in a row)", outcome.step, loss, norm, self.state.bad_steps)
            self.run.event("bad_step", step=outcome.step, loss=str(loss))
        return False

    def check_bad_steps(self) -> None:
        """check_bad_steps ends the run after train.max_bad_steps non-finite steps in a row:
        checked where every rank has read the same steps, so all stop at the same one."""
        t = self.cfg.train
        if self.state.bad_steps >= t.max_bad_steps:
            raise said_once(TrainingError(
                f"{self.state.bad_steps} consecutive steps had a non-finite loss or gradient "
                f"(train.max_bad_steps={t.max_bad_steps}); lower train.lr or check the data"),
                self.rank)

    def settled_state(self) -> dict[str, int]:
        """settled_state is the train state with every step's outcome counted (a checkpoint
        reads it through this: a save waits for the last step's two numbers)."""
        self.settle()
        return self.state.to_dict()

    def state_later(self) -> Callable[[], dict[str, int]]:
        """state_later is what `settled_state` would return now, without waiting for the step
        still on its way from the device: a function to call once that step is done (memory
        mode's snapshot calls it in its copy's thread, after the copy, which the device runs
        after the step). It reads; the loop still counts the step when it settles it.

        A snapshot every step used to settle every step, and the GPU stood idle while the
        host took the snapshot and queued the next step (H200, gpt-125m: 0.924 of no
        checkpoint)."""
        now = self.state.to_dict()
        pending = self.pending
        if pending is None:
            return lambda: now

        def later() -> dict[str, int]:
            return {**now, "bad_steps": bad_steps_after(now["bad_steps"], *pending.read())}
        return later

    def _phase(self, name: str, step: int | None = None) -> None:
        """_phase tells the watchdog that `name` begins (and lets a test hang there)."""
        self.watchdog.phase(self.phase_names.get(name, name), step)
        faults.maybe_hang(name, self.watchdog.step, self.rank)  # (PYRECOVER_HANG_PHASE=forward)

    def _log(self, step: int, loss: float, grad_norm: float, tok_s: float, step_s: float) -> None:
        lr = self.optimizer.param_groups[0]["lr"]
        record = dict(step=step, loss=loss, lr=lr, grad_norm=grad_norm,
                      tokens_per_s=round(tok_s, 1), step_time=round(step_s, 5),
                      tokens_seen=self.state.tokens_seen,
                      checkpoint_stall_total=round(self.manager.stall_seconds, 5))
        use = flops.mfu(tok_s, self.flops_per_token, self.peak_flops, self.world_size)
        if use is not None:
            record["mfu"] = float(f"{use:.3g}")  # a tiny model's MFU is 1e-5, not 0
        self.run.metric(**record)
        self.tracker.log(step, record)
        if self.progress is None:  # on a terminal the bar shows the same
            log.info("step %d/%d  loss %.4f  lr %.2e  %.0f tok/s  %.1f ms/step%s", step,
                     self.cfg.train.max_steps, loss, lr, tok_s, step_s * 1e3,
                     f"  MFU {use:.1%}" if use is not None else "")
