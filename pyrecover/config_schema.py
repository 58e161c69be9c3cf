"""The configuration's schema: every section and key with its default and meaning.

The defaults are the embedded CPU demo, so `pyrecover train` with no file still does
something useful. `pyrecover.config` reads and validates files against it; this module
imports nothing of the project.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A user mistake in the configuration: one line naming the key and what is allowed."""


CHECKPOINT_MODES = ("vanilla", "dcp", "memory")
WANDB_MODES = ("auto", "offline", "online", "disabled")
PRECISIONS = ("auto", "fp32", "bf16")
DEVICES = ("auto", "cpu", "cuda")
PARALLELS = ("ddp", "fsdp")
_EXP_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # always fullmatch: `$` passes "x\n"


@dataclass
class RunConfig:
    exp_name: str = "demo"
    """Names the run directory `<storage>/<exp_name>`: letters, digits, `.`, `_`, `-`."""
    storage: str = "runs"
    """Root folder of all run directories (relative paths are taken from the working dir)."""
    stop_signal: str = "USR2"
    """Signal that asks for a clean stop (save, exit 75, requeue); SIGTERM always does too.
    USR2 by default because NCCL may use USR1."""
    hang_timeout: str = "auto"
    """Seconds a phase of a step may run before the rank counts as hung (stacks, `hang`
    event, exit 76); `auto`: 10 x the slowest step so far, within 60-600 s; `off`: no watchdog."""
    hang_startup_timeout: float = 900.0
    """The same for the first step of a start, a checkpoint load, and a save (loads and saves:
    counted from their last read or write)."""
    straggler_interval: int = 50
    """Every this many steps the ranks compare their own compute time; 0 turns it off."""
    straggler_factor: float = 1.5
    """A rank this many times slower than the median counts as slow in a window."""
    straggler_windows: int = 3
    """Slow windows in a row before a `straggler` event."""
    health_check: bool = True
    """Check each task's GPUs, memory and storage, then one collective, before training (a
    few seconds); a failure exits 77 and the job script excludes the node. false: skip."""


@dataclass
class ModelConfig:
    vocab_size: int = 320
    """Byte-level tokens use 0-255 and 256 as end of document; the rest pads to a multiple of 64."""
    block_size: int = 128
    """Context length in tokens."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads per block; must divide n_embd."""
    n_embd: int = 128
    """Width: the embedding and residual stream size."""
    dropout: float = 0.0
    """Dropout probability in attention and MLP (0: none, the usual for pre-training)."""
    bias: bool = False
    """Biases in the linear layers and layer norms."""


@dataclass
class DataConfig:
    path: str = "runs/stdlib.parquet"  # what `make demo` builds
    """Parquet corpus; `pyrecover data prepare SRC_DIR OUT.parquet` builds one."""
    column: str = "text"
    """A string column (byte-level tokens) or a list-of-integers column (already tokenized)."""


@dataclass
class TrainConfig:
    max_steps: int = 300
    """Optimizer steps of the whole run; raising it later continues a finished run."""
    global_batch_size: int | str = "auto:16"
    """Sequences per optimizer step, summed over all ranks and accumulation micro-steps.
    `N`: exactly N, refused unless it splits over the ranks; `auto:N`: N where it splits,
    otherwise the nearest multiple of world size x micro_batch_size; `auto`: one micro batch
    per rank. The number an `auto` value resolves to is recorded in run.yaml and kept on
    resume (`resolve_global_batch`)."""
    micro_batch_size: int = 8
    """Sequences per forward pass on one rank."""
    seed: int = 1337
    """Seeds the weights, the data order and every rank's dropout stream."""
    lr: float = 1e-3
    """Peak learning rate, reached after warmup_steps, then a cosine decay to min_lr at
    max_steps."""
    min_lr: float = 1e-4
    """The learning rate at max_steps; at most lr."""
    warmup_steps: int = 20
    """Steps of linear warm-up to lr."""
    weight_decay: float = 0.1
    """AdamW's decoupled weight decay, on every parameter of 2 or more dimensions (matrices
    and embeddings), not on norms or biases."""
    beta1: float = 0.9
    """AdamW's first-moment decay."""
    beta2: float = 0.95
    """AdamW's second-moment decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    max_bad_steps: int = 5
    """Stop with an error after this many consecutive steps with a NaN/inf loss or gradient."""
    log_interval: int = 10
    """Steps between log lines and metrics.jsonl rows (the host reads a step's loss only at
    these)."""
    precision: str = "auto"
    """`auto` is bf16 autocast on CUDA and fp32 on CPU."""
    device: str = "auto"
    """`auto`: CUDA where torch sees a GPU (one per rank), else CPU; `cpu` or `cuda`."""
    compile: str = "auto"
    """`torch.compile` the model: `auto` is on for CUDA and off on CPU; `true` or `false`."""
    parallel: str = "ddp"
    """`ddp`: every rank holds the whole model and optimizer; `fsdp`: FSDP2 shards both over
    the ranks (one unit per transformer block; on CUDA bf16 compute, fp32 master weights), for
    models that do not fit one GPU."""
    profile: str = ""
    """`A-B`: record steps A to B with torch.profiler on every rank, a trace per rank under
    <run>/profile/ and the device's time per step in the log (profiling.py); empty: off."""


@dataclass
class CheckpointConfig:
    mode: str = "vanilla"
    """`vanilla`: one torch.save file, written by rank 0; `dcp`: torch.distributed.checkpoint,
    every rank writes its part (sharded, asynchronous by default); `memory`: replicated CPU
    snapshots every snapshot_interval steps, on disk every interval."""
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
    gather_max_gb: float = 8.0
    """train.parallel=fsdp: the most GB of model and optimizer state a mode may put together
    whole (vanilla on rank 0 for its single file, memory on every rank when it restores); a
    larger state is refused at start: use dcp, which never gathers."""


@dataclass
class TrackingConfig:
    wandb: str = "auto"
    """`auto`: WANDB_MODE if set, else online when a wandb API key is configured, else offline."""
    project: str = "pyrecover"
    """wandb project."""
    entity: str = ""
    """wandb team or user; empty: the API key's default entity."""
    group: str = ""
    """wandb group; a sweep's trials get the sweep's name unless it is set."""
    tags: str = ""
    """Comma-separated, e.g. `baseline,125m`."""
    name: str = ""
    """Display name of the wandb run; empty: run.exp_name."""
    sweep_id: str = ""
    """The wandb sweep the run belongs to (its page lists the run); `pyrecover sweep launch`
    sets it for each trial when it registered the sweep with wandb."""


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
