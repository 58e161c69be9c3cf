"""The global batch for a world size: `train.global_batch_size` as N, `auto:N` or `auto`.

Pure. `pyrecover launch` resolves it for the job's world size before it writes run.yaml (the
number goes there, with a comment saying how it was chosen); `pyrecover train` resolves it
for its own world size, keeping what run.yaml recorded.
"""

from __future__ import annotations

import dataclasses
import typing

from pyrecover.config import Config, ConfigError, parse_global_batch


def resolve_global_batch(value: int | str, micro: int, world_size: int,
                         recorded: int | None = None) -> tuple[int, str | None]:
    """resolve_global_batch returns the global batch to train with and, for `auto`, one line
    saying what it chose.

    `N` must split into world_size x micro; `auto:N` keeps N when it does and otherwise takes
    the nearest multiple (the smaller one on a tie, never 0); `auto` is one micro batch per
    rank. `recorded` is what run.yaml already holds: an `auto` run keeps it, or is refused
    where it no longer splits, so a resumed run never changes its global batch silently.
    """
    per_step = world_size * micro
    target = parse_global_batch(value)
    shape = f"world size x train.micro_batch_size ({world_size} x {micro} = {per_step})"
    if isinstance(value, int):
        if value % per_step:
            bad("train.global_batch_size", value, f"a multiple of {shape}, or auto:{value}")
        return value, None
    if recorded is not None:
        if recorded % per_step:
            raise ConfigError(
                f"train.global_batch_size={value!r}: this run recorded {recorded} in run.yaml, "
                f"which is not a multiple of {shape}; a resumed run keeps its global batch: "
                "use a world size it splits over, or a new run.exp_name")
        return recorded, f"train.global_batch_size={value}: {recorded}, as recorded in run.yaml"
    if target is None:
        chosen = per_step
    else:
        below = max(per_step, target // per_step * per_step)
        above = -(-target // per_step) * per_step
        chosen = below if target - below <= above - target else above
    kept = "kept" if chosen == target else "chosen"
    accumulation = chosen // per_step
    return chosen, (f"train.global_batch_size={value}: {chosen} sequences {kept} for {shape}, "
                    f"{accumulation} accumulation step{'s' if accumulation > 1 else ''}")


def with_global_batch(cfg: Config, size: int) -> Config:
    """with_global_batch returns `cfg` training with exactly `size` sequences per step."""
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=size))


def resolve(cfg: Config, world_size: int, recorded: int | None = None
            ) -> tuple[Config, str | None]:
    """resolve returns `cfg` with its global batch fixed for `world_size` (and the note)."""
    size, note = resolve_global_batch(cfg.train.global_batch_size, cfg.train.micro_batch_size,
                                      world_size, recorded)
    return with_global_batch(cfg, size), note


def bad(key: str, value: typing.Any, allowed: str) -> typing.NoReturn:
    raise ConfigError(f"{key}={value!r} is not allowed: expected {allowed}")
