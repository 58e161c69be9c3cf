"""`pyrecover train`: parse -> build -> train, resuming from the run directory by itself.

Every rank runs `main`. The process group is joined in one place and always left again in
`finally`, whatever the loop raised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import logging
import os
import sys
import time
from pathlib import Path

import torch

from pyrecover import (
    batch,
    compiling,
    dist,
    flops,
    hang_report,
    health,
    heartbeat,
    ledger,
    parallel,
    peers,
    preempt,
    profiling,
    progress,
    runlock,
    straggler,
    tracking,
    watchdog,
)
from pyrecover import config as config_mod
from pyrecover import system as system_info
from pyrecover.checkpoint import CheckpointManager, rng
from pyrecover.checkpoint import interval as checkpoint_interval
from pyrecover.checkpoint.manager import Parts
from pyrecover.checkpoint.mode import train_state_problem
from pyrecover.checkpoint.resume import beats as resume_beats
from pyrecover.checkpoint.resume import choose_in_background
from pyrecover.checkpoint.store import CheckpointError
from pyrecover.config import Config, ConfigError
from pyrecover.config_checks import parse_profile_window
from pyrecover.data import Batches, DataError, check_tokens, fingerprint, load_tokens
from pyrecover.devices import autocast_for, device_kind, kind_name
from pyrecover.experiment import (
    check_corpus,
    hold_run_dir,
    hold_same_corpus,
    prepare_run_dir,
    record_start_error,
    recorded_global_batch,
    wait_for_start_error,
)
from pyrecover.loop import Loop, TrainingError, TrainState
from pyrecover.model import GPT, GPTConfig, empty_gpt, initialize
from pyrecover.oneline import first_line
from pyrecover.optim import apply_changes, build_optimizer, build_scheduler
from pyrecover.phases import Phases, process_start_time
from pyrecover.preempt import StopRequested
from pyrecover.rundir import RunDir, StorageError, read_jsonl
from pyrecover.runlock import HeldByThisJob, RunLock, RunLocked
from pyrecover.startup import bytecode_note, end_startup_imports

log = logging.getLogger("pyrecover")


def setup_logging(rank: int) -> None:
    """setup_logging sends rank 0's progress to stderr; other ranks report warnings only."""
    handler = logging.StreamHandler(sys.stderr)
    fmt = "%(asctime)s [pyrecover] %(message)s" if rank == 0 else \
        f"%(asctime)s [pyrecover rank {rank}] %(levelname)s %(message)s"
    handler.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def main(cfg: Config, run_dir: Path) -> None:
    """main trains one rank of the job until train.max_steps, resuming where a checkpoint is."""
    env = dist.detect(os.environ)
    phases = Phases(env.rank)  # phases.py: this start's timings, written as events by rank 0
    phases.mark("process_start", process_start_time())
    phases.mark("imports_done", **bytecode_note())  # where torch was compiled from
    setup_logging(env.rank)
    run = RunDir(run_dir)
    # The run is named by its folder (--run-dir too), as run.yaml records it and as a restart
    # from run.yaml names it: the wandb run and the logged config, of the first start too.
    storage, name = run.where
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, storage=storage,
                                                           exp_name=name))
    try:  # config and data errors surface here, on every rank, before any collective
        cfg, batch_note = batch.resolve(cfg, env.world_size, recorded_global_batch(run))
        kind = device_kind(cfg)
        if kind == "cuda":
            config_mod.check_local_gpus(cfg, env.local_world_size, torch.cuda.device_count(),
                                        per_task=True)
        tokens = load_tokens(cfg.data.path, cfg.data.column)
        check_tokens(tokens, cfg.model.vocab_size, cfg.model.block_size, cfg.data.path)
        corpus = check_corpus(run, fingerprint(tokens), cfg.data.path)
        phases.mark("data_ready")
    except (ConfigError, DataError) as exc:
        if env.rank == 0:
            record_start_error(run, phases, exc)
        if env.rank != 0:  # exiting before rank 0 recorded it would get rank 0 ended unheard
            wait_for_start_error(run)
            if env.node_rank == 0:
                raise SystemExit(2) from None  # rank 0 read the same files and says it once
        raise
    lock = RunLock(run)
    refused: Exception | None = None  # another live run holds the run directory (rank 0's
    try:  # lock), run.yaml refuses the config, or storage fails: said once the group is up
        if env.rank == 0:  # the lock first: a refused start writes nothing into the folder
            if batch_note:
                log.info("%s", batch_note)
            prepare_run_dir(cfg, run, batch_note, lock, runlock.lock_wait_seconds(), corpus)
            phases.attach(run)
        else:
            run.create()
    except (RunLocked, HeldByThisJob, StorageError, ConfigError) as exc:
        refused = exc
    # Issue 15: a bad node is found here, in seconds, and excluded by the job script.
    checks = cfg.run.health_check  # a refused rank 0 skips its own: the folder is not its own
    local = checks and refused is None
    health_s = health.before_group(cfg, env, run, kind, dist.node_name()) if local else 0.0
    # The process caught stop signals from its first moment (preempt.catch_early).
    flag = preempt.take_over((cfg.run.stop_signal, "SIGTERM", "SIGINT"))  # and earlier ones
    # Ctrl-C's line, once per node: torchrun's workers share the terminal's stderr
    flag.announce = sys.stderr.isatty() and not os.environ.get(dist.SPAWNED) and \
        env.local_rank == 0
    # Issue 14: the hang watchdog; torch's own timeout is set above its limits (backstop).
    rule = watchdog.rule_from(cfg.run.hang_timeout, cfg.run.hang_startup_timeout)
    try:  # the lock is released however this start ends (the process may live on: bench)
        m = cfg.model  # the checkpoint's size: a pass over it may outlast the step limits
        state = health.approx_params(m.n_layer, m.n_embd, m.vocab_size, m.block_size) * \
            health.CHECKPOINT_BYTES_PER_PARAM
        device = dist.setup(env, kind, timeout_s=watchdog.backstop_seconds(rule, state))
        phases.mark("group_up")
        hold_run_dir(refused, env)
        hold_same_corpus(corpus, env, cfg.data.path, run)
        if checks:
            health.after_group(run, env, dist.node_name(), health_s)
    except BaseException as exc:
        if isinstance(exc, dist.DistError) and env.rank == 0 and refused is None:
            run.event("error", rank=0, error=f"DistError: {exc}")  # two ranks on one GPU
        lock.release()
        raise
    managers: list[CheckpointManager] = []

    def persist() -> None:
        if managers:
            managers[0].persist_after_failure()

    # A rank that stops altogether cannot report its hang: its heartbeat names it instead.
    beats = heartbeat.start(env.master_addr, env.master_port, env.rank, env.world_size,
                            dist.node_name(), env.store_attempt) if env.is_distributed else None
    def progress() -> int:  # and rank 0's beats while it chooses a checkpoint (resume.py)
        return (watchdog.io_bytes() + watchdog.saving_bytes(run.checkpoints)
                + resume_beats(run.checkpoints))

    dog = watchdog.Watchdog(rule, env.rank, dist.node_name(), on_hang=lambda hang: (
        hang_report.handle(hang, run.event, persist, device, silent=beats and beats.silent,
                           leaving=beats and functools.partial(beats.stop, wait=False),
                           progress=watchdog.io_bytes)), progress=progress).start()
    try:
        _train(cfg, run, env, device, tokens, managers, flag, dog, phases)
    except StorageError:
        raise  # the run directory cannot be written: record nothing
    except StopRequested:
        raise  # recorded (_train), no failure
    except Exception as exc:
        # Stopped before persisting, so this path's own work is never taken for a hang; one
        # that already fired ends the process with EXIT_HANG inside this call.
        dog.stop()
        # (a permission no requeue gives: the CLI ends it as a user error, exit 2)
        user_error = isinstance(exc, (ConfigError, DataError, CheckpointError, TrainingError)
                                ) or _permission_in(exc, run.root)
        error = f"{type(exc).__name__}: {first_line(exc)}"
        if user_error and beats is not None:  # the peers its leaving frees name this rank
            beats.say_error(error)
        # (read before a persist, which may outlast the store of a rank 0 that stopped)
        gone = peers.lost(env.rank, exc, beats) if peers.peer_lost(exc) else None
        if not user_error:
            hang_report.persist_once(persist)  # once, whether this thread or the watchdog is first
        stopped = isinstance(gone, peers.PeerStopped)  # rank 0 records whose error it was
        if env.rank == 0 or (gone and not stopped):
            run.event("error" if user_error or stopped else "crash", rank=env.rank,
                      error=f"rank {gone.rank}: {gone.reason}" if stopped else error)
        if gone is not None:
            raise gone from exc
        raise
    finally:
        dog.stop()
        # Free DDP (its reducer holds gloo work) before the group goes: destroying the group
        # under a live DDP aborted a rank now and then ("terminate called without an active
        # exception", about 1 job in 7 on the local SLURM cluster; 0 in 36 with this).
        # teardown collects the garbage first.
        managers.clear()
        if beats is not None:  # rank 0 waits for the others' `exit` once the group is gone
            beats.stop(wait=False)
        try:
            dist.teardown(then=beats and beats.wait_for_the_others)
        except Exception as exc:  # a group with a dead member may not shut down cleanly
            log.debug("process group teardown failed: %s", exc)
        lock.release()
        phases.mark("exit")
        gc.enable()


def _permission_in(exc: BaseException, root: Path) -> bool:
    """_permission_in: `exc` is a permission refused on the run directory's own files, which
    no requeue gives (a node's /tmp or /dev/shm refusing one is that node's: it requeues)."""
    if not isinstance(exc, PermissionError) or exc.filename is None:
        return False
    path = os.path.realpath(os.fsdecode(exc.filename))
    return os.path.commonpath([path, os.path.realpath(root)]) == os.path.realpath(root)


def _train(cfg: Config, run: RunDir, env: dist.DistEnv, device: torch.device,
           tokens: torch.Tensor, managers: list[CheckpointManager],
           flag: preempt.StopFlag, dog: watchdog.Watchdog, phases: Phases) -> None:
    t = cfg.train
    # Rank 0 reads the checkpoint to resume while the model is built (find_resume takes it).
    chosen = choose_in_background(run.checkpoints, run.event) if env.rank == 0 else None
    began = time.perf_counter()
    torch.manual_seed(t.seed)  # same initial weights on every rank
    shape = GPTConfig(**config_mod.to_dict(cfg)["model"])
    sharded = t.parallel == "fsdp" and env.world_size > 1
    compiled = compiling.compile_enabled(cfg, device, log)
    if compiled:  # every attempt after the first finds its kernels there (compiling.py);
        compiling.use_cache(run.compile_cache)  # before torch._inductor reads the variable
    # Weights are initialized only where nothing is restored (below); FSDP shards an
    # initialized model, as before.
    model = GPT(shape).to(device) if sharded else empty_gpt(shape, device)
    n_params = model.num_params()
    if device.type == "cuda":  # TF32 for what is not under bf16 autocast
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if sharded:  # before the optimizer, which must hold the shards (parallel.py)
        parallel.shard(model, device, t.precision, compile_blocks=compiled)
        parallel.check_gather(model, cfg.checkpoint.mode, cfg.checkpoint.gather_max_gb)
    elif compiled:
        # In place: the module keeps its parameter names, so checkpoints and exports never see
        # `_orig_mod.` and a compiled run resumes an eager checkpoint and the reverse.
        model.compile()
    optimizer = build_optimizer(model, cfg, device)
    if env.world_size > 1 or cfg.checkpoint.mode != "vanilla" or compiled:
        # DDP's constructor and DCP's state_dict helpers import it later; here it is beside
        # rank 0's checksum pass, with the collector off. A vanilla eager run of one rank
        # never needs it (optim.AdamW).
        importlib.import_module("torch._dynamo")
    end_startup_imports()  # the garbage collector back on
    scheduler = build_scheduler(optimizer, cfg)
    batches = Batches(tokens, cfg.model.block_size, t.seed)
    state = TrainState()
    loop: Loop | None = None  # below; a save reads the train state through it (settled_state)
    parts = Parts(model=model, optimizer=optimizer, scheduler=scheduler,
                  config=config_mod.to_dict(cfg), train_state=lambda: (
                      loop.settled_state() if loop is not None else state.to_dict()),
                  train_state_later=lambda: (
                      loop.state_later() if loop is not None
                      else (lambda now: lambda: now)(state.to_dict())))
    auto_past = env.rank == 0 and cfg.checkpoint.interval == "auto"
    interval, auto = checkpoint_interval.for_config(
        cfg.checkpoint.interval, cfg.checkpoint.mtbf_hours, t.max_steps,
        run.read_events() if auto_past else [], read_jsonl(run.metrics) if auto_past else [])
    manager = CheckpointManager(run, cfg.checkpoint.mode, interval,
                                cfg.checkpoint.keep, env.rank, env.world_size, parts, device,
                                cfg.checkpoint.async_save, cfg.checkpoint.snapshot_interval,
                                cfg.checkpoint.replicas, env.local_world_size)
    manager.auto = auto
    manager.chosen = chosen
    managers.append(manager)  # main() persists through it if a peer dies
    layout = "fsdp" if sharded else "ddp"  # how the ranks share the model (parallel.py)
    if env.rank == 0:
        log.info("run %s: %s, world size %d (%s, %s), %.2fM parameters, %d windows of %d "
                 "tokens", run.root, kind_name(device), env.world_size, env.launcher,
                 layout, n_params / 1e6, batches.num_windows,
                 cfg.model.block_size)
    system = system_info.diagnostics(env, device) if env.rank == 0 else {}
    for line in system_info.describe(system, cfg) if system else []:
        log.info("%s", line)  # versions, devices, layout, SLURM job, resolved config
    dog.phase("load")
    restore_started = time.perf_counter()
    built_s = round(restore_started - began, 3)

    def chosen_phase(step: int) -> None:
        """Its first mark says where the seconds went: the model, the optimizer and the
        manager built (built_s), the background checksum pass beside them (verify_s), and
        the wait for it (wait_s). A fall-back's pick is not timed."""
        first = "checkpoint_chosen" not in phases.seen
        phases.mark("checkpoint_chosen", step=step,
                    **({"built_s": built_s, **manager.choice_times} if first else {}))

    found = manager.resume(accept=lambda r: (train_state_of(r.train),
                                             r.rng is None or rng.check(r.rng)),
                           on_chosen=lambda c: chosen_phase(c.step),
                           keep_weights=sharded)  # an empty_gpt is initialized below instead
    if found is None:
        if not sharded:
            initialize(model, t.seed)
        chosen_phase(0)
        rng.seed_rank(t.seed, env.rank)
        if env.rank == 0:
            run.event("start", step=0, world_size=env.world_size, mode=cfg.checkpoint.mode,
                      parallel=layout)
    else:
        ckpt, restored = found
        restore_s = time.perf_counter() - restore_started
        phases.mark("restored")
        state = train_state_of(restored.train)
        batches.position = state.data_position
        if restored.rng is not None and ckpt.manifest["world_size"] == env.world_size:
            rng.restore(restored.rng)
        else:  # another world size: the old ranks' streams do not map onto the new ones
            rng.seed_rank(t.seed + state.step, env.rank)
        changed = apply_changes(optimizer, scheduler, cfg)  # a new lr, weight decay or betas
        if env.rank == 0 and changed:
            log.info("from step %d on: %s (the config's, not the checkpoint's)", state.step,
                     "; ".join(changed))
        if env.rank == 0:
            lost = ledger.steps_redone(run.read_events(), run.read_metrics(), state.step)
            log.info("resumed from %s (step %d, %d steps redone; restored in %.2fs)", ckpt.path,
                     state.step, lost, restore_s)
            run.event("resume", step=state.step, path=str(ckpt.path), steps_lost=lost,
                      world_size=env.world_size, saved_world_size=ckpt.manifest["world_size"],
                      mode=ckpt.mode, restore_seconds=round(restore_s, 4), verified=ckpt.checked,
                      parallel=layout)
    dog.phase("setup")
    if env.world_size > 1 and not sharded:
        model = parallel.replicate(model, device, env.world_size, lambda: batches.windows(
            batches.window_ids(0, t.micro_batch_size)), autocast_for(cfg, device))
    autocast = contextlib.nullcontext if sharded and parallel.mixed_precision(
        device, t.precision) else autocast_for(cfg, device)  # FSDP casts the blocks itself

    profiler = profiling.StepProfiler(parse_profile_window(t.profile), run.profile, env.rank,
                                      device, state.step, run.event if env.rank == 0 else None,
                                      dog.phase)

    def after_step(step: int) -> None:
        phases.once("first_step", lambda: compiling.first_step_fields(compiled, run))
        profiler.after_step(step)

    loop = Loop(cfg=cfg, model=model, optimizer=optimizer, scheduler=scheduler, batches=batches,
                manager=manager, run=run, rank=env.rank, world_size=env.world_size,
                device=device, state=state, autocast=autocast,
                flops_per_token=flops.flops_per_token(cfg.model, n_params),
                peak_flops=flops.peak_flops(torch.cuda.get_device_name(device))
                if device.type == "cuda" else None,
                tracker=tracking.start(cfg, run, env.rank, system) if state.step < t.max_steps
                else tracking.Tracker(),  # a finished run's start is no restart to log
                progress=progress.for_terminal(env.rank, t.max_steps, state.step),
                stopper=preempt.Stopper(flag, preempt.Deadline(
                    preempt.job_end_time(os.environ), preempt.env_margin()), env.rank,
                    env.world_size),
                watchdog=dog, stragglers=straggler.StragglerWatch(
                    cfg.run.straggler_interval, cfg.run.straggler_factor,
                    cfg.run.straggler_windows, env.world_size,
                    dist.gather_objects(dist.node_name(), env.world_size)),
                on_step=after_step)
    if state.step >= t.max_steps:
        log.info("nothing to do: step %d already reached train.max_steps=%d", state.step,
                 t.max_steps)
    # Closes the wandb run (failed if the loop raised), a profile. The stop's or the finish's
    # records come first: the run's summary holds the ledger they end.
    with loop.tracker, profiler:
        try:
            loop.run_steps()
        except StopRequested as stop:
            if env.rank == 0:
                stop.record(flag, phases.mark, run.event)
                log.info("%s", stop)
            raise
        dog.phase("checkpoint")
        manager.finish(state.step)
        dog.phase("idle")
        loop.tracker.after_step(state.step)
        if env.rank == 0:
            run.event("finish", step=state.step, tokens_seen=state.tokens_seen,
                      checkpoint_stall_total=round(manager.stall_seconds, 5))  # the ledger's
            log.info("finished at step %d; run directory %s", state.step, run.root)


def train_state_of(saved: dict) -> TrainState:
    """train_state_of is a checkpoint's train state, refused unless every field is a count."""
    if problem := train_state_problem(saved):
        raise ValueError(problem)
    return TrainState(**saved)
