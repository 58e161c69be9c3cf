"""The trials of a sweep: which values each one gets, and the validated Config it runs.

`choose(sweep)` is pure and deterministic: a grid in file order (the last parameter varies
fastest), cut at run_cap; random draws from `random.Random(sweep.seed)`, parameter by
parameter in file order, rounded to 12 significant digits so the values read back from
`sweep.yaml` are the values drawn. `configs(...)` builds each trial's Config from the
experiment and checks it as `pyrecover train` would, before anything is written.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import random
from typing import Any

from pyrecover import batch
from pyrecover import config as config_mod
from pyrecover.config import Config, ConfigError
from pyrecover.sweep import SweepError
from pyrecover.sweep.spec import Param, Scalar, Sweep

TRIAL_PREFIX = "trial-"
OWNED = ("run.exp_name", "run.storage")
# What a trial whose recorded config a relaunch changes can take (its name is the sweep's).
RENAME = "a new sweep name (name: in the sweep file, or another file name)"
"""Keys the sweep sets itself: each trial's folder is `<storage>/<sweep name>/trial-<i>`."""


def trial_name(index: int) -> str:
    """trial_name is the run directory's name of trial `index` (SLURM's %a, unpadded)."""
    return f"{TRIAL_PREFIX}{index}"


def choose(sweep: Sweep) -> list[dict[str, Scalar]]:
    """choose returns each trial's parameter values, in trial order."""
    if sweep.method == "grid":
        grid = itertools.islice(itertools.product(*(p.values for p in sweep.params)),
                                sweep.run_cap)  # None: every combination
        return [dict(zip((p.key for p in sweep.params), combo, strict=True)) for combo in grid]
    rng = random.Random(sweep.seed)
    return [{p.key: draw(p, rng) for p in sweep.params} for _ in range(sweep.run_cap or 0)]


def draw(p: Param, rng: random.Random) -> Scalar:
    """draw picks one value of `p`; it uses exactly one rng.random() per call."""
    u = rng.random()
    if p.distribution == "constant":
        return p.values[0]
    if p.distribution == "categorical":
        return p.values[min(int(u * len(p.values)), len(p.values) - 1)]
    if p.distribution == "int_uniform":
        low, high = int(p.low), int(p.high)
        return min(low + int(u * (high - low + 1)), high)
    if p.distribution == "log_uniform_values":
        value = math.exp(math.log(p.low) + u * (math.log(p.high) - math.log(p.low)))
        return _round(min(max(value, p.low), p.high))
    value = p.low + u * (p.high - p.low)
    if p.distribution == "q_uniform":
        value = round(value / p.q) * p.q
        if all(float(x).is_integer() for x in (p.q, p.low, p.high)):
            return int(value)
    return _round(value)


def configs(sweep: Sweep, base: Config, chosen: list[dict[str, Scalar]],
            world_size: int | None = None) -> list[Config]:
    """configs builds and validates each trial's Config; raises SweepError for the first bad
    trial, naming it and the config's complaint. `base` has absolute paths."""
    check_owned(sweep, base)
    cfgs = [trial_config(sweep.name, base, index, values, world_size)
            for index, values in enumerate(chosen)]
    check_metric(sweep, {f"trial {i}": c for i, c in enumerate(cfgs)})
    return cfgs


def check_metric(sweep: Sweep, cfgs: dict[str, Config]) -> None:
    """check_metric refuses a ranking by a metric that trials (named by the keys) never log:
    MFU on the CPU, which has no bf16 peak to measure it against (a sweep said "best: none
    yet" for ever)."""
    on_cpu = next((what for what, c in cfgs.items() if c.train.device == "cpu"), None)
    if sweep.metric == "mfu" and on_cpu is not None:
        raise SweepError(f"metric.name='mfu': {on_cpu} trains on the CPU (train.device=cpu), "
                         "where no MFU is measured (it needs a GPU's bf16 peak); rank by "
                         "tokens_per_s instead")


def check_owned(sweep: Sweep, base: Config) -> None:
    """check_owned refuses a parameter that no trial may have to itself: its folder, and the
    stop signal, which the one array script asks SLURM to send to every trial."""
    owned = next((p.key for p in sweep.params if p.key in OWNED), None)
    if owned is not None:
        raise SweepError(f"parameters.{owned}: the sweep sets it (each trial runs in "
                         f"<run.storage>/{sweep.name}/{TRIAL_PREFIX}<i>)")
    if any(p.key == "run.stop_signal" for p in sweep.params):
        raise SweepError(f"parameters.run.stop_signal: the job array sends every trial the "
                         f"experiment's stop signal ({base.run.stop_signal}), which a trial "
                         "waiting for another would not survive; set it with --set instead")


def check_sets(sweep: Sweep, source: object, sets: list[str], mode: str | None = None) -> None:
    """check_sets refuses a --set (or --mode) that no trial would keep: a swept key (each
    trial's value replaces it), run.exp_name (the sweep's name names the folder), or the
    wandb project or entity the sweep file names."""
    swept = {p.key for p in sweep.params}
    if mode is not None and "checkpoint.mode" in swept:
        raise SweepError(f"--mode (checkpoint.mode): {source} sweeps it, so every trial would "
                         "replace it with its own value; leave out one or the other")
    for item in sets:
        key = config_mod.parse_override(item)[0]
        if key in swept:
            raise SweepError(f"--set {key}: {source} sweeps it, so every trial would replace "
                             "it with its own value; leave out one or the other")
        if key == "run.exp_name":
            raise SweepError(f"--set {key}: the sweep's name names its folder ({sweep.name}); "
                             f"set name: in {source} instead")
        named = {"tracking.project": sweep.project, "tracking.entity": sweep.entity}.get(key)
        if named:  # base_for gives every trial the sweep file's
            raise SweepError(f"--set {key}: {source} names {key.partition('.')[2]}: {named}, "
                             "where every trial logs and wandb registers the sweep; leave out "
                             "one or the other")


def trial_config(name: str, base: Config, index: int, values: dict[str, Any],
                 world_size: int | None = None, what: str | None = None) -> Config:
    """trial_config is trial `index` of sweep `name`: `base` (run dir: the sweep's folder) in
    the trial's folder, with `values` set and, for a `world_size`, its global batch resolved
    for it; raises SweepError naming `what` (default: the trial and its values) and the
    config's complaint."""
    raw = config_mod.to_dict(base)
    raw["run"].update(storage=str(base.run_dir().parent / name), exp_name=trial_name(index))
    tracking = raw["tracking"]
    tracking["group"] = tracking["group"] or name
    # Each trial's wandb run named apart: a --set tracking.name=X named every one X.
    tracking["name"] = f"{tracking['name'] or name}-{trial_name(index)}"
    what = what or f"trial {index} ({describe(values)})"
    for key, value in values.items():
        section, _, leaf = key.partition(".")
        if not leaf or "." in leaf or not isinstance(raw.get(section), dict):
            raise SweepError(f"parameters.{key}: not a config key; expected section.key "
                             f"with section one of {', '.join(raw)}")
        if leaf not in raw[section]:
            raise SweepError(f"parameters.{key}: unknown config key; known under "
                             f"{section}: {', '.join(raw[section])}")
        raw[section][leaf] = value
    try:
        cfg = config_mod.from_dict(raw, f"sweep {name}")
        if world_size is not None:
            config_mod.check_world_size(cfg, world_size)
            # An `auto` global batch resolved as `launch` resolves it: run.yaml holds the
            # number the trainer trains with (kept 'auto:16', the trial's first start saw
            # its own 16 as another config and refused to train).
            cfg = batch.resolve(cfg, world_size)[0]
    except ConfigError as exc:
        raise SweepError(f"{what}: {exc}") from None
    return cfg


def resolved(cfg: Config, keys: list[str]) -> dict[str, Any]:
    """resolved reads the swept keys back from a trial's Config (1e-3 the string is 0.001)."""
    raw = config_mod.to_dict(cfg)
    return {k: raw[k.partition(".")[0]][k.partition(".")[2]] for k in keys}


def describe(values: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in values.items())


def repeats(chosen: list[dict[str, Any]]) -> list[str]:
    """repeats says each trial whose values an earlier one has (a grid's list that names a
    value twice, random draws of discrete values that met): with the same seed it would
    train the very same run again."""
    first: dict[str, int] = {}
    said = []
    for index, values in enumerate(chosen):
        key = describe(values)
        if key in first:
            said.append(f"trial {index} has the values of trial {first[key]} ({key}): it "
                        "trains the same run again; drop the repeated value, or sweep "
                        "train.seed too")
        first.setdefault(key, index)
    return said


PATH_KEYS = ("data.path",)
"""Swept keys that name a file: a trial starts in its sweep's folder, not where `sweep
launch` ran, so a relative value must not reach its run.yaml."""


def absolute_values(sweep: Sweep, cwd: str) -> Sweep:
    """absolute_values makes every relative value of a PATH_KEYS parameter absolute from `cwd`,
    as `launch` does the experiment's own paths. A bayes sweep's values are handed to each
    trial by wandb's controller as the sweep file gives them: a relative one is refused."""
    params = []
    for p in sweep.params:
        if p.key in PATH_KEYS:  # `~/c.parquet` is in the home folder, as in the config
            p = dataclasses.replace(p, values=tuple(
                os.path.expanduser(v) if isinstance(v, str) else v for v in p.values))
        relative = [v for v in p.values if p.key in PATH_KEYS and isinstance(v, str)
                    and not os.path.isabs(v)]
        if relative and sweep.method == "bayes":
            raise SweepError(f"parameters.{p.key}: {relative[0]!r} is a relative path, and a "
                             "bayes trial gets it from wandb as written, in its sweep's folder; "
                             "give absolute paths")
        if relative:
            p = dataclasses.replace(p, values=tuple(
                os.path.abspath(os.path.join(cwd, v)) if isinstance(v, str) else v
                for v in p.values))
        params.append(p)
    return dataclasses.replace(sweep, params=tuple(params))


def base_for(sweep: Sweep, cfg: Config) -> Config:
    """base_for is the experiment as the job array sees it: run dir = the sweep's folder, and
    the sweep file's wandb project and entity, where it names them, the trials' (wandb
    registers the sweep there, and a run of another project is not the sweep's)."""
    tracking = dataclasses.replace(cfg.tracking, project=sweep.project or cfg.tracking.project,
                                   entity=sweep.entity or cfg.tracking.entity)
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, exp_name=sweep.name),
                               tracking=tracking)


def _round(value: float) -> float:
    return float(f"{value:.12g}")
