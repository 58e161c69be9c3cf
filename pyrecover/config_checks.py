"""The configuration's rules: values and their relations, checked once a Config is built.

Every user mistake raises `ConfigError` naming the key, the bad value (cut short: an error
never repeats a huge value) and what is allowed.
"""

from __future__ import annotations

import math
import re
import typing
from typing import Any

from pyrecover.config_schema import (
    _EXP_NAME,
    CHECKPOINT_MODES,
    DEVICES,
    PARALLELS,
    PRECISIONS,
    WANDB_MODES,
    Config,
    ConfigError,
    RunConfig,
)


def validate(cfg: Config) -> None:
    """validate checks values and their relations; raises ConfigError naming the first bad key."""
    name = cfg.run.exp_name
    if not isinstance(name, str) or not _EXP_NAME.fullmatch(name) or ".." in name:
        _bad("run.exp_name", cfg.run.exp_name, "1 to 128 letters, digits, '.', '_' and '-', "
             "starting with a letter or digit, no '..'")
    tags = cfg.tracking.tags
    if isinstance(tags, str) and any(c in tags for c in "[]{}"):
        _bad("tracking.tags", tags, "tags separated by commas, e.g. tracking.tags=baseline,"
                                    "lr-sweep (no brackets)")
    if cfg.run.stop_signal.upper().removeprefix("SIG") not in ("USR1", "USR2", "TERM", "INT",
                                                                 "HUP", "XCPU"):
        _bad("run.stop_signal", cfg.run.stop_signal, "one of USR1, USR2, TERM, INT, HUP, XCPU")
    if not cfg.run.storage:
        _bad("run.storage", cfg.run.storage, "a folder path")
    _check_watchdog(cfg.run)
    m = cfg.model
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        _positive(f"model.{key}", getattr(m, key))
    for key, most in _MOST.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) > most:
            _bad(key, getattr(getattr(cfg, section), name), f"at most {most}")
    if m.vocab_size < 257:
        _bad("model.vocab_size", m.vocab_size, "at least 257 (256 byte values and end-of-doc)")
    if m.n_embd % m.n_head:
        _bad("model.n_embd", m.n_embd, f"a multiple of model.n_head ({m.n_head})")
    if not 0.0 <= m.dropout < 1.0:
        _bad("model.dropout", m.dropout, "0 <= dropout < 1")
    if not cfg.data.path:
        _bad("data.path", cfg.data.path, "the path of a parquet file")
    t = cfg.train
    for key in ("max_steps", "micro_batch_size", "max_bad_steps"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.log_interval", t.log_interval)
    if t.micro_batch_size > MAX_GLOBAL_BATCH:
        _bad("train.micro_batch_size", t.micro_batch_size,
             f"a number of sequences from 1 to {MAX_GLOBAL_BATCH:,}")
    target = parse_global_batch(t.global_batch_size)
    if isinstance(t.global_batch_size, int) and target % t.micro_batch_size:
        _bad("train.global_batch_size", t.global_batch_size,
             f"a multiple of train.micro_batch_size ({t.micro_batch_size})")
    if t.lr <= 0:
        _bad("train.lr", t.lr, "a learning rate > 0")
    if t.min_lr < 0 or t.min_lr > t.lr:
        _bad("train.min_lr", t.min_lr, f"0 <= min_lr <= lr ({t.lr})")
    for key in ("beta1", "beta2"):
        if not 0.0 <= getattr(t, key) < 1.0:
            _bad(f"train.{key}", getattr(t, key), "0 <= value < 1")
    if t.weight_decay < 0:
        _bad("train.weight_decay", t.weight_decay, ">= 0")
    if not 0 <= t.seed < 2**63:
        _bad("train.seed", t.seed, "0 <= seed < 2**63")
    if t.warmup_steps < 0:
        _bad("train.warmup_steps", t.warmup_steps, ">= 0")
    if t.grad_clip < 0:
        _bad("train.grad_clip", t.grad_clip, ">= 0 (0 turns clipping off)")
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.device", t.device, DEVICES)
    _choice("train.compile", t.compile, ("auto", "true", "false"))
    _choice("train.parallel", t.parallel, PARALLELS)
    try:
        window = parse_profile_window(t.profile)
    except ValueError as exc:
        _bad("train.profile", t.profile, str(exc))
    if window is not None and window[0] > t.max_steps:  # (a window the run ends inside is cut)
        _bad("train.profile", t.profile, f"a window starting at or before train.max_steps="
                                         f"{t.max_steps}: the run never reaches step {window[0]}")
    c = cfg.checkpoint
    _choice("checkpoint.mode", c.mode, CHECKPOINT_MODES)
    if c.interval != "auto":
        if isinstance(c.interval, str):
            _bad("checkpoint.interval", c.interval, "an integer >= 1 or auto")
        _positive("checkpoint.interval", c.interval)
    if not c.mtbf_hours > 0:
        _bad("checkpoint.mtbf_hours", c.mtbf_hours, "a number of hours > 0")
    _positive("checkpoint.snapshot_interval", c.snapshot_interval)
    _positive("checkpoint.replicas", c.replicas)
    if not c.gather_max_gb > 0:
        _bad("checkpoint.gather_max_gb", c.gather_max_gb, "a number of GB > 0")
    if c.keep < 2:
        _bad("checkpoint.keep", c.keep, "at least 2, so a failed save never leaves no checkpoint")
    _choice("tracking.wandb", cfg.tracking.wandb, WANDB_MODES)


def _check_watchdog(r: RunConfig) -> None:
    text = r.hang_timeout.strip().lower()
    if text not in ("auto", "off"):
        try:
            seconds = float(text)
        except ValueError:
            seconds = 0.0
        if not (math.isfinite(seconds) and seconds > 0):
            _bad("run.hang_timeout", r.hang_timeout, "auto, off, or a number of seconds > 0")
    if not r.hang_startup_timeout > 0:
        _bad("run.hang_startup_timeout", r.hang_startup_timeout, "a number of seconds > 0")
    if r.straggler_interval < 0:
        _bad("run.straggler_interval", r.straggler_interval, ">= 0 (0 turns it off)")
    if not r.straggler_factor > 1:
        _bad("run.straggler_factor", r.straggler_factor, "a number > 1")
    _positive("run.straggler_windows", r.straggler_windows)


def check_world_size(cfg: Config, world_size: int) -> None:
    """check_world_size raises unless a fixed global batch splits over ranks and micro-batches
    (an `auto` one always fits: pyrecover.batch resolves it)."""
    size = cfg.train.global_batch_size
    per_step = world_size * cfg.train.micro_batch_size
    if isinstance(size, int) and size % per_step:
        _bad("train.global_batch_size", size,
             f"a multiple of world size x train.micro_batch_size ({world_size} x "
             f"{cfg.train.micro_batch_size} = {per_step}), or auto:{size}")


_AUTO = re.compile(r"auto(?::(\d+))?")


# Every step lists its sequences' window ids: a global batch past this (over a billion tokens
# a step at 1024 tokens each, far more than any run uses) would build that list until memory
# ran out rather than train.
MAX_GLOBAL_BATCH = 2**20


def parse_global_batch(value: int | str) -> int | None:
    """parse_global_batch reads `N`, `auto:N` (the target N) or `auto` (None: no target)."""
    if isinstance(value, int) and not isinstance(value, bool):
        target: int | None = value
    else:
        m = _AUTO.fullmatch(str(value).strip().lower())
        if not m:
            _bad("train.global_batch_size", value, "a number of sequences N, auto:N or auto")
        target = int(m.group(1)) if m.group(1) else None
    if target is not None and not 1 <= target <= MAX_GLOBAL_BATCH:
        _bad("train.global_batch_size", value,
             f"a number of sequences from 1 to {MAX_GLOBAL_BATCH:,}")
    return target


def check_local_gpus(cfg: Config, local_processes: int, visible_gpus: int,
                     per_task: bool = False) -> None:
    """check_local_gpus raises unless each of `local_processes` processes on this machine gets
    a GPU of its own when the run trains on CUDA (NCCL refuses two ranks on one device).

    `per_task`: the count is one task's own view, where SLURM may show each task only the GPU
    it was given; one visible GPU is then left to the ranks' comparison once the group is up
    (dist.check_own_gpus)."""
    if cfg.train.device == "cpu" or local_processes <= visible_gpus:
        return
    if cfg.train.device == "auto" and visible_gpus == 0:
        return  # auto trains on the CPU where there is no GPU
    if per_task and visible_gpus == 1:
        return
    fewer = f"start at most {visible_gpus} (--nproc {visible_gpus}) or " if visible_gpus else ""
    raise ConfigError(
        f"{local_processes} processes on this machine need {local_processes} GPUs, but "
        f"{visible_gpus} {'is' if visible_gpus == 1 else 'are'} visible; {fewer}train on the "
        "CPU (--set train.device=cpu)")


# Sizes past these are typos, and would only fail later inside torch (or fill the memory).
_MOST = {"model.vocab_size": 1 << 24, "model.block_size": 1 << 20, "model.n_layer": 1024,
         "model.n_head": 1024, "model.n_embd": 1 << 16}


PROFILE_MOST_STEPS = 50


def parse_profile_window(text: str) -> tuple[int, int] | None:
    """parse_profile_window is the (first, last) step of `train.profile`, None for "";
    ValueError for anything but "A" or "A-B" with 1 <= A <= B."""
    text = str(text).strip()
    if not text:
        return None
    first, sep, last = text.partition("-")
    try:
        a, b = int(first), int(last) if sep else int(first)
    except ValueError:
        raise ValueError("steps A-B (e.g. 20-22) or one step A, or empty for none") from None
    if not 1 <= a <= b:
        raise ValueError("steps A-B with 1 <= A <= B")
    if b - a + 1 > PROFILE_MOST_STEPS:  # the profiler holds every operator of them in memory
        raise ValueError(f"at most {PROFILE_MOST_STEPS} steps (a few show a step's pattern; "
                         "the profiler keeps every operator of every step in memory)")
    return a, b


def short(value: Any, limit: int = 80) -> str:
    """short is repr(value) cut to `limit` characters: an error never repeats a huge value."""
    if isinstance(value, (dict, list, tuple, set)) and len(value) > 20:
        return f"<a {type(value).__name__} of {len(value)} items>"
    text = repr(value)
    if len(text) <= limit:
        return text
    length = len(value) if isinstance(value, str) else len(text)  # (a string's, not its repr's)
    return f"{text[:limit]}... ({length} characters)"


def _bad(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{key}={short(value)} is not allowed: expected {allowed}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        _bad(key, value, "an integer >= 1")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _bad(key, value, "one of " + ", ".join(allowed))
