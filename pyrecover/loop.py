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

from pyrecover import faults, flops, parallel
from pyrecover.checkpoint import CheckpointManager
from pyrecover.config import Config
from pyrecover.data import Batches
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
    on_step: Callable[[int], None] | None = None  # after each step's update (phase timings)

    def run_steps(self) -> TrainState:
        t = self.cfg.train
        tokens_per_step = t.global_batch_size * self.cfg.model.block_size
        window_start, window_steps = time.perf_counter(), 0
        while self.state.step < t.max_steps:
            step_started = time.perf_counter()
            loss, grad_norm = self.one_step()
            faults.maybe_delay()
            _, own_s = self.watchdog.step_done()  # issue 14: step time for the hang limit
            self.state.step += 1
            self.state.tokens_seen += tokens_per_step
            self.state.data_position = self.batches.position
            window_steps += 1
            step = self.state.step
            if self.on_step is not None:
                self.on_step(step)
            if self.progress is not None:
                self.progress.update(step, loss, tokens_per_step)
            if self.rank == 0 and (step % t.log_interval == 0 or step == t.max_steps):
                elapsed = time.perf_counter() - window_start
                self._log(step, loss, grad_norm, tokens_per_step * window_steps / elapsed,
                          elapsed / window_steps)
                window_start, window_steps = time.perf_counter(), 0
            self._phase("checkpoint")
            self.manager.at_step(step, final=step == t.max_steps)
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
                    self._phase("checkpoint")
                    self.manager.finish(step)  # the stop checkpoint, committed before exit
                    raise StopRequested(step, reason)
            self.tracker.after_step(step)
            faults.maybe_kill(step, self.rank)
            faults.maybe_kill_on_file(self.rank, self.world_size)
        if self.progress is not None:
            self.progress.close()
        return self.state

    def one_step(self) -> tuple[float, float]:
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
        # One device-to-host transfer (a sync on CUDA) for both numbers, not two.
        loss_value, norm_value = torch.stack([total, grad_norm.float()]).tolist()
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
            self.state.bad_steps += 1
            self.optimizer.zero_grad(set_to_none=True)
            self.scheduler.step()
            if self.rank == 0:
                log.warning("step %d: non-finite loss %s or gradient norm %s; update skipped "
                            "(%d in a row)", self.state.step + 1, loss_value, norm_value,
                            self.state.bad_steps)
                self.run.event("bad_step", step=self.state.step + 1, loss=str(loss_value))
            if self.state.bad_steps >= t.max_bad_steps:
                raise TrainingError(
                    f"{self.state.bad_steps} consecutive steps had a non-finite loss or gradient "
                    f"(train.max_bad_steps={t.max_bad_steps}); lower train.lr or check the data")
            return loss_value, norm_value
        self.state.bad_steps = 0
        # The state is about to change: a background save must have finished copying it (on
        # CUDA the update waits on the device; the host goes on).
        self.manager.before_update()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return loss_value, norm_value

    def _phase(self, name: str, step: int | None = None) -> None:
        """_phase tells the watchdog that `name` begins (and lets a test hang there)."""
        self.watchdog.phase(name, step)
        faults.maybe_hang(name, self.watchdog.step, self.rank)

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
