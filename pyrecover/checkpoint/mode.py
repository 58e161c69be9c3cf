"""What a checkpoint mode is: the protocol the manager drives, and the records they exchange.

A mode writes and reads one on-disk format. The manager depends on this module and on the
modes (the `MODES` table of modes.py names them); a mode depends on this module and on the
store, never on the manager. Adding a mode is one new module, implementing `Mode` for runs
and `Offline` for `pyrecover ckpt` (module-level functions), and a line in each of
`modes.MODES` and `modes.OFFLINE` (tests/unit/test_house.py checks the second).

One save, as the manager runs it on every rank: `start(pending, parts, train)` begins writing
this rank's files into `pending.tmp`; `wait_staged()` returns once the save no longer reads
the live state (the optimizer may change it then); `result(wait)` is None while the write is
still going and a `WriteResult` once this rank's files are durable and hashed. The manager
gathers every rank's result and commits (or discards) the checkpoint as a whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from pyrecover.checkpoint.store import Checkpoint, Pending

__all__ = ["Checkpoint", "Mode", "ModelBuilder", "ModeSettings", "Offline", "Parts", "Pending",
           "Restored", "Snapshotting", "TrainArg", "WriteResult", "Writer", "train_now"]

# A save's train state: the dict, or (an asynchronous save, a snapshot) a function that gives
# it once the step the device still runs is done, so the loop need not wait for that step.
TrainArg = dict[str, Any] | Callable[[], dict[str, Any]]


# A config's model section -> a module of that shape, for a mode that reads weights into one.
# The caller passes it (pyrecover/offline.py): checkpoint/ builds no model itself.
ModelBuilder = Callable[[dict[str, Any]], torch.nn.Module]


def train_now(train: TrainArg) -> dict[str, Any]:
    """train_now is the train state itself (the function called where it is one)."""
    return train() if callable(train) else train


# The loop's TrainState fields (the checkpoint code never imports the loop; a test keeps the
# two in step): a train state a resume can restore has no others, each a count.
TRAIN_STATE_KEYS = ("step", "tokens_seen", "data_position", "bad_steps")


def train_state_problem(saved: object) -> str:
    """train_state_problem is "" for a train state a resume can restore, else why not."""
    if not isinstance(saved, dict):
        return f"train state {saved!r} is not an object"
    other = sorted(str(k) for k in saved if k not in TRAIN_STATE_KEYS)[:3]
    if other:
        return f"train state has fields this version does not know: {', '.join(other)}"
    bad = {k: v for k, v in saved.items() if type(v) is not int or v < 0}
    return f"train state {bad} is not made of counts" if bad else ""


@dataclass
class Parts:
    """The live objects a checkpoint captures and restores (the model unwrapped from DDP, or
    sharded in place by FSDP: then its parameters and optimizer state are DTensor shards)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    config: dict[str, Any]
    train_state: Callable[[], dict[str, Any]]
    # The same without waiting for the step the device still runs: a function that gives
    # it once that step is done (the loop's `state_later`); snapshots take it. None: the
    # settled one.
    train_state_later: Callable[[], Callable[[], dict[str, Any]]] | None = None


@dataclass
class Restored:
    """What a restore hands back besides the live parts it loaded."""

    train: dict[str, Any]
    rng: dict[str, Any] | None  # this rank's generators, None when it had no saved rank


class WriteResult(NamedTuple):
    """One rank's answer for a save: its files (name -> size and checksum), or why it failed.

    A tuple, so it travels through `all_gather_object` as plain data.
    """

    files: dict[str, Any]
    error: str = ""


@dataclass(frozen=True)
class ModeSettings:
    """How the run configured its checkpoints; each mode takes what concerns it."""

    device: torch.device
    async_save: bool = True
    replicas: int = 2
    ranks_per_node: int | None = None


@runtime_checkable
class Mode(Protocol):
    """A checkpoint format: start a save, report its files, restore, close."""

    name: str
    asynchronous: bool  # whether a save goes on after `start` returns

    def start(self, pending: Pending, parts: Parts, train: TrainArg) -> None:
        """Begin writing this rank's files of the save into `pending.tmp`. An asynchronous
        mode gets `train` as a function (the manager's `_start`): it calls it off the loop's
        thread, once its copy of the state is done."""

    def prepare(self, parts: Parts) -> None:
        """Allocate, in the background, what saves (and snapshots) will reuse; called once the
        optimizer has its state (after the first step), long before the first save."""

    def wait_staged(self) -> None:
        """Return once the save in flight no longer reads the live state."""

    def device_waits(self, drain: bool = False) -> list[tuple[float, float]]:
        """The device's waits at `wait_staged` that ended since the last call, each (seconds,
        when it ended on `time.perf_counter`'s clock) (CUDA: the host does not wait there, the
        loop's stream does); `drain` waits for pending ones."""

    def result(self, wait: bool) -> WriteResult | None:
        """This rank's result once its files are durable and hashed; None while writing."""

    def restore(self, ckpt: Checkpoint, parts: Parts) -> Restored:
        """Load `ckpt` into the live parts; return the train state and this rank's RNG."""

    def close(self) -> None:
        """Let a save in flight end; release threads and buffers."""


@runtime_checkable
class Snapshotting(Mode, Protocol):
    """A mode that also keeps in-memory snapshots between its disk checkpoints."""

    def snapshot(self, step: int, parts: Parts,
                 train: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """Take this rank's snapshot of the state at `step`; `train` may be a function that
        gives the train state once the copy of the step's state is done."""

    def persist_survivor(self, root: Path) -> list[int]:
        """Write what this rank holds after a peer died, with no collective; the steps."""


@runtime_checkable
class Offline(Protocol):
    """What `pyrecover ckpt` reads of a mode's checkpoint in one process, with no process
    group: the mode's own module implements it (modes.offline), so the ckpt tools know no
    mode's files. The live objects are the caller's (pyrecover/offline.py), on the CPU."""

    def check_readable(self, ckpt: Checkpoint) -> None:
        """Raise where what a restore reads first does not load safely; reads no tensor."""

    def read_config(self, ckpt: Checkpoint) -> dict[str, Any]:
        """The resolved config the checkpoint was made with."""

    def read_model(self, ckpt: Checkpoint, build_model: ModelBuilder
                   ) -> dict[str, torch.Tensor]:
        """The model's weights as plain CPU tensors; a tied head is the embedding's tensor."""

    def read_all(self, ckpt: Checkpoint, parts: Parts) -> list[dict[str, Any]]:
        """Load the whole state into `parts`; the generator states of every saved rank."""


@runtime_checkable
class Writer(Protocol):
    """How `pyrecover ckpt convert --to` writes a format (modes.CONVERT_TO): a file or folder
    for other tools, with no manifest, not a step of a run."""

    def write_all(self, out: Path, parts: Parts, train: dict[str, Any],
                  rngs: list[dict[str, Any]]) -> None:
        """Write `parts`, `train` and every rank's `rngs` at `out` (absent before)."""
