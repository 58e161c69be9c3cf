"""Experiment configuration: nested dataclasses, YAML, `--set` overrides, validation.

Precedence is `--set section.key=value` > YAML file > the defaults below. The defaults are
the embedded CPU demo, so `pyrecover train` with no file still does something useful.
Every user mistake raises `ConfigError` with the key, the bad value and what is allowed.
This module imports nothing else from the project.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A user mistake in the configuration: one line naming the key and what is allowed."""


CHECKPOINT_MODES = ("vanilla", "dcp", "memory")
WANDB_MODES = ("auto", "offline", "online", "disabled")
PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
_EXP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass
class RunConfig:
    exp_name: str = "demo"
    """Names the run directory `<storage>/<exp_name>`: letters, digits, `.`, `_`, `-`."""
    storage: str = "runs"
    """Root folder of all run directories (relative paths are taken from the working dir)."""
    stop_signal: str = "USR2"
    """Signal that asks for a clean stop (save, exit 75, requeue); SIGTERM always does too.
    USR2 by default because NCCL may use USR1."""


@dataclass
class ModelConfig:
    vocab_size: int = 320
    """Byte-level tokens use 0-255 and 256 as end of document; the rest pads to a multiple of 64."""
    block_size: int = 128
    """Context length in tokens."""
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False


@dataclass
class DataConfig:
    path: str = "data/stdlib.parquet"
    """Parquet corpus; `pyrecover data prepare SRC_DIR OUT.parquet` builds one."""
    column: str = "text"
    """A string column (byte-level tokens) or a list-of-integers column (already tokenized)."""


@dataclass
class TrainConfig:
    max_steps: int = 300
    global_batch_size: int = 16
    """Sequences per optimizer step, summed over all ranks and accumulation micro-steps."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one rank."""
    seed: int = 1337
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    max_bad_steps: int = 5
    """Stop with an error after this many consecutive steps with a NaN/inf loss or gradient."""
    log_interval: int = 10
    precision: str = "auto"
    """`auto` is bf16 autocast on CUDA and fp32 on CPU."""
    device: str = "auto"
    compile: str = "auto"
    """`torch.compile` the model: `auto` is on for CUDA and off on CPU; `true` or `false`."""


@dataclass
class CheckpointConfig:
    mode: str = "vanilla"
    interval: int | str = 50
    """Save every this many optimizer steps (and always at the last step), or `auto`: the
    Young/Daly interval sqrt(2 x stall x MTBF) from the measured save stall and step time and
    the failures this run has seen (checkpoint/interval.py), re-chosen after every save."""
    mtbf_hours: float = 24.0
    """`interval: auto` only: the mean time between failures assumed before any was seen."""
    keep: int = 3
    """Committed checkpoints kept on disk; at least 2, so one bad save never leaves nothing."""
    async_save: bool = True
    """dcp: write in the background; the loop waits only for the copy into CPU memory."""
    snapshot_interval: int = 5
    """memory: steps between in-memory snapshots (a crash loses at most this many steps)."""
    replicas: int = 2
    """memory: copies of each rank's slice, on distinct ranks (on other nodes when possible)."""


@dataclass
class TrackingConfig:
    wandb: str = "auto"
    """`auto`: WANDB_MODE if set, else online when a wandb API key is configured, else offline."""
    project: str = "pyrecover"
    entity: str = ""
    """wandb team or user; empty: the API key's default entity."""
    group: str = ""
    tags: str = ""
    """Comma-separated, e.g. `baseline,125m`."""
    name: str = ""
    """Display name of the wandb run; empty: run.exp_name."""


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def run_dir(self) -> Path:
        """run_dir is `<storage>/<exp_name>`; the name was validated not to leave storage."""
        return Path(self.run.storage) / self.run.exp_name


# Keys that change what a resumed run computes; a restart that changes one is refused.
IDENTITY_KEYS = ("model", "data", "train.seed", "train.global_batch_size")


def to_dict(cfg: Config) -> dict[str, Any]:
    """to_dict returns plain nested dicts, ready for YAML, JSON or a checkpoint."""
    return dataclasses.asdict(cfg)


def from_dict(raw: Any, source: str = "config") -> Config:
    """from_dict builds and validates a Config from nested mappings, rejecting unknown keys."""
    cfg = _build(Config, raw if raw is not None else {}, "", source)
    validate(cfg)
    return cfg


def load(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """load reads a YAML file (or the defaults when None) and applies `key=value` overrides."""
    raw: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            raw = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{p}{where}: not valid YAML") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: expected a mapping of sections, got {type(raw).__name__}")
        source = str(p)
    for item in overrides:
        key, value = parse_override(item)
        _set_path(raw, key, value)
    return from_dict(raw, source)


def parse_override(item: str) -> tuple[str, Any]:
    """parse_override splits `section.key=value`; the value is read as YAML (`3`, `1e-3`)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not re.fullmatch(r"[a-z_]+(\.[a-z_0-9]+)+", key):
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. train.max_steps=100")
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        value = text
    if not isinstance(value, (str, int, float, bool)):
        value = text  # lists and mappings are not config values; keep the literal text
    return key, value


def dump(cfg: Config) -> str:
    """dump renders the resolved config as YAML that `load` reads back to an equal Config."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def diff_identity(old: Config, new: Config) -> list[str]:
    """diff_identity lists `key: old -> new` for identity keys that differ between two configs."""
    a, b = _flatten(to_dict(old)), _flatten(to_dict(new))
    return [
        f"{k}: {a.get(k)!r} -> {b.get(k)!r}"
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k) and any(k == p or k.startswith(p + ".") for p in IDENTITY_KEYS)
    ]


def validate(cfg: Config) -> None:
    """validate checks values and their relations; raises ConfigError naming the first bad key."""
    if not _EXP_NAME.match(cfg.run.exp_name) or ".." in cfg.run.exp_name:
        _bad("run.exp_name", cfg.run.exp_name, "letters, digits, '.', '_' and '-', no '/' or '..'")
    if cfg.run.stop_signal.upper().removeprefix("SIG") not in ("USR1", "USR2", "TERM", "INT",
                                                                 "HUP", "XCPU"):
        _bad("run.stop_signal", cfg.run.stop_signal, "one of USR1, USR2, TERM, INT, HUP, XCPU")
    if not cfg.run.storage:
        _bad("run.storage", cfg.run.storage, "a folder path")
    m = cfg.model
    for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        _positive(f"model.{key}", getattr(m, key))
    if m.vocab_size < 257:
        _bad("model.vocab_size", m.vocab_size, "at least 257 (256 byte values and end-of-doc)")
    if m.n_embd % m.n_head:
        _bad("model.n_embd", m.n_embd, f"a multiple of model.n_head ({m.n_head})")
    if not 0.0 <= m.dropout < 1.0:
        _bad("model.dropout", m.dropout, "0 <= dropout < 1")
    if not cfg.data.path:
        _bad("data.path", cfg.data.path, "the path of a parquet file")
    t = cfg.train
    for key in ("max_steps", "global_batch_size", "micro_batch_size", "max_bad_steps"):
        _positive(f"train.{key}", getattr(t, key))
    _positive("train.log_interval", t.log_interval)
    if t.global_batch_size % t.micro_batch_size:
        _bad("train.global_batch_size", t.global_batch_size,
             f"a multiple of train.micro_batch_size ({t.micro_batch_size})")
    if t.lr <= 0 or t.min_lr < 0 or t.min_lr > t.lr:
        _bad("train.min_lr", t.min_lr, f"0 <= min_lr <= lr ({t.lr}) and lr > 0")
    if t.warmup_steps < 0:
        _bad("train.warmup_steps", t.warmup_steps, ">= 0")
    if t.grad_clip < 0:
        _bad("train.grad_clip", t.grad_clip, ">= 0 (0 turns clipping off)")
    _choice("train.precision", t.precision, PRECISIONS)
    _choice("train.device", t.device, DEVICES)
    _choice("train.compile", t.compile, ("auto", "true", "false"))
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
    if c.keep < 2:
        _bad("checkpoint.keep", c.keep, "at least 2, so a failed save never leaves no checkpoint")
    _choice("tracking.wandb", cfg.tracking.wandb, WANDB_MODES)


def check_world_size(cfg: Config, world_size: int) -> None:
    """check_world_size raises unless the global batch splits over ranks and micro-batches."""
    per_step = world_size * cfg.train.micro_batch_size
    if cfg.train.global_batch_size % per_step:
        _bad("train.global_batch_size", cfg.train.global_batch_size,
             f"a multiple of world size x train.micro_batch_size ({world_size} x "
             f"{cfg.train.micro_batch_size} = {per_step})")


def check_local_gpus(cfg: Config, local_processes: int, visible_gpus: int) -> None:
    """check_local_gpus raises unless each of `local_processes` processes on this machine gets
    a GPU of its own when the run trains on CUDA (NCCL refuses two ranks on one device)."""
    if cfg.train.device == "cpu" or local_processes <= visible_gpus:
        return
    if cfg.train.device == "auto" and visible_gpus == 0:
        return  # auto trains on the CPU where there is no GPU
    raise ConfigError(
        f"{local_processes} processes on this machine need {local_processes} GPUs, but "
        f"{visible_gpus} {'is' if visible_gpus == 1 else 'are'} visible; start at most "
        f"{visible_gpus} (--nproc {visible_gpus}) or train on the CPU (--set train.device=cpu)")


def _bad(key: str, value: Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{key}={value!r} is not allowed: expected {allowed}")


def _positive(key: str, value: int) -> None:
    if value < 1:
        _bad(key, value, "an integer >= 1")


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        _bad(key, value, "one of " + ", ".join(allowed))


def _build(cls: type, raw: Any, prefix: str, source: str) -> Any:
    if not isinstance(raw, dict):
        where = prefix.rstrip(".") or "top level"
        raise ConfigError(f"{source}: {where} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        key = prefix + str(unknown[0])
        raise ConfigError(
            f"{source}: unknown key {key!r}; known under {prefix.rstrip('.') or 'top level'}: "
            + ", ".join(fields)
        )
    kwargs = {}
    for name, value in raw.items():
        hint = hints[name]
        key = prefix + name
        if dataclasses.is_dataclass(hint):
            kwargs[name] = _build(hint, value or {}, key + ".", source)
        else:
            kwargs[name] = _coerce(key, value, hint)
    return cls(**kwargs)


def _coerce(key: str, value: Any, hint: Any) -> Any:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if any(isinstance(value, a) and not isinstance(value, bool) for a in options):
            return value  # `int | str`: 50 stays an int, `auto` a string
        hint = options[0]
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is float and isinstance(value, str):
        try:  # YAML 1.1 reads `2e-3` (no dot) as a string
            value = float(value)
        except ValueError:
            pass
    if hint is float and isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}={value!r} is not allowed: expected a finite number")
    if hint is str and isinstance(value, bool):
        return "true" if value else "false"  # `compile: true` in YAML
    if hint is str and isinstance(value, (int, float)):
        return str(value)
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(
            f"{key}={value!r} is not allowed: expected a value of type {hint.__name__}")
    return value


def _set_path(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: {part!r} is a value, not a section")
        node = child
    node[leaf] = value


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
