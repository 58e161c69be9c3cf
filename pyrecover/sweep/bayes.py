"""A bayes sweep's trials: each gets its values from wandb's controller, once, at its start.

The job array has run_cap tasks, and no trial's values are known at launch: wandb's
controller chooses them from the results so far. So the launch records the experiment every
trial starts from (`<sweep dir>/base.yaml`) and checks, before anything is submitted, that
the values the sweep file allows make a valid config (`check_launch`). The job script then
runs `pyrecover sweep values TRIAL_DIR` before the trial's first step: `take` asks wandb
(agent.py) for a run the first time, checks the values it gets, and records them in the
trial's folder:

    trial-<i>/wandb/run-id              the run id wandb handed out: the trial's wandb run
    trial-<i>/wandb/sweep-params.yaml   the values in wandb's config-file format, which the
                                        trial's wandb run takes as wandb's own agent gives them
    trial-<i>/run.yaml                  the trial's config with its values, written last

run.yaml is the commit: a trial that has one has its values, and every later start (a
requeue, a relaunch) reads them there and asks nothing. Each file is written atomically. A
value the config or the sweep file refuses is one line (SweepError, exit 2) and nothing is
written; the next start asks again.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pyrecover import config as config_mod
from pyrecover.config import Config, ConfigError
from pyrecover.experiment import check_run_dir, prepare_run_dir, write_config
from pyrecover.rundir import RunDir, replace_text
from pyrecover.sweep import SweepError, agent, record, spec, trials
from pyrecover.tracking import RUN_ID_FILE, SWEEP_PARAMS

BASE = "base.yaml"
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")

Ask = Callable[[str, Config], agent.Run]
"""ask(sweep_id, trial config) -> the run wandb's controller hands out."""


@dataclass(frozen=True)
class Taken:
    values: dict[str, Any]
    run_id: str | None
    """None: recorded once, but its wandb/ folder was removed since (the trial's wandb
    logging then starts a new run)."""
    asked: bool
    """False: recorded at an earlier start; wandb was not asked."""


def edges(p: spec.Param) -> list[Any]:
    """edges are the values of `p` that a launch checks: every choice, or both ends."""
    if p.distribution in ("categorical", "constant"):
        return list(p.values)
    if p.distribution == "q_uniform":  # wandb picks round(uniform(min, max) / q) * q
        ends = [round(x / p.q) * p.q for x in (p.low, p.high)]
        if all(float(x).is_integer() for x in (p.q, p.low, p.high)):
            return [int(x) for x in ends]
        return [float(f"{x:.12g}") for x in ends]  # 0.30000000000000004 as 0.3
    if p.distribution == "int_uniform":
        return [int(p.low), int(p.high)]
    return [p.low, p.high]


def check_launch(sweep: spec.Sweep, base: Config, world_size: int | None) -> None:
    """check_launch builds the config with each parameter at each of its edges (the others at
    their first): a key that is no config key, or a value the config refuses, is one line
    before anything is written or submitted."""
    trials.check_owned(sweep, base)
    first = {p.key: edges(p)[0] for p in sweep.params}
    built = {}
    for p in sweep.params:
        for value in edges(p):
            built[f"a trial with {p.key}={value!r}"] = trials.trial_config(
                sweep.name, base, 0, {**first, p.key: value}, world_size,
                f"parameters.{p.key}={value!r} (a value wandb may choose)")
    trials.check_metric(sweep, built)


def check_values(sweep: spec.Sweep, args: Any) -> dict[str, Any]:
    """check_values turns a run's args ({key: {value: v}}) into {key: v}, refusing a key the
    sweep does not have, a missing key, and a value outside its parameter's values or range."""
    if not isinstance(args, dict) or not all(
            isinstance(v, dict) and "value" in v for v in args.values()):
        raise SweepError(f"wandb handed out args that are not {{key: {{value: ...}}}}: "
                         f"{str(args)[:200]}")
    got = {str(k): v["value"] for k, v in args.items()}
    want = [p.key for p in sweep.params]
    extra = sorted(set(got) - set(want))
    if extra or set(want) - set(got):
        raise SweepError(f"wandb handed out values for {sorted(got)}, the sweep has "
                         f"parameters {sorted(want)}")
    for p in sweep.params:
        value = got[p.key]
        if p.key in trials.PATH_KEYS and isinstance(value, str):
            # wandb has the file as written (~/a.parquet); the record, the values launch
            # checked (/home/me/a.parquet). Kept as handed: the config expands it too.
            value = os.path.expanduser(value)
        if not _allowed(p, value):
            raise SweepError(f"wandb handed out {p.key}={got[p.key]!r}, outside parameters."
                             f"{p.key} ({p.distribution} {_domain(p)})")
    return {k: got[k] for k in want}


def _allowed(p: spec.Param, value: Any) -> bool:
    if p.distribution in ("categorical", "constant"):
        return any(value == v and type(value) is type(v) or _same_number(value, v)
                   for v in p.values)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    # q_uniform rounds to a multiple of q, which may lie up to q/2 past min or max
    slack = p.q / 2 if p.distribution == "q_uniform" else 0.0
    low, high = p.low - slack - 1e-9 * abs(p.low), p.high + slack + 1e-9 * abs(p.high)
    if not math.isfinite(value) or not low <= value <= high:
        return False
    return p.distribution != "int_uniform" or float(value).is_integer()


def _same_number(a: Any, b: Any) -> bool:
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
    return numbers and float(a) == float(b)


def _domain(p: spec.Param) -> str:
    if p.distribution in ("categorical", "constant"):
        return "values " + ", ".join(map(repr, p.values))
    return f"min {p.low:g}, max {p.high:g}"


def check_relaunch(sweep_dir: Path, base: Config, world_size: int | None
                   ) -> list[tuple[Config, RunDir]]:
    """check_relaunch refuses, writing nothing, what a relaunch with `base` would: an
    experiment that changes what the trials compute (as a run's restart is refused), and a
    started trial whose recorded config does not read or would not restart with it. Returns
    each started trial's config and folder (`--dry-run` asks it too)."""
    _check_base(sweep_dir, base)
    if not (sweep_dir / record.RECORD).is_file():
        return []  # a new sweep: no trial has started
    rec = record.read(sweep_dir)
    keys = list(rec.parameters or {})
    started = []
    for t in rec.trials:
        trial = sweep_dir / t["dir"]
        values = recorded(trial, keys)
        if values is not None:
            cfg = _at(trials.trial_config(rec.name, base, int(t["index"]), values, world_size,
                                          f"trial {t['index']}"), trial)
            check_run_dir(cfg, RunDir(trial), trials.RENAME)
            started.append((cfg, RunDir(trial)))
    return started


def _check_base(sweep_dir: Path, cfg: Config) -> None:
    """_check_base refuses an experiment that changes what the recorded one computes."""
    if (sweep_dir / BASE).is_file():
        changed = config_mod.diff_identity(load_base(sweep_dir), cfg)
        if changed:
            raise SweepError(f"{sweep_dir} was launched with another experiment "
                             f"({'; '.join(changed)}); give this sweep another name")


def keep_base(sweep_dir: Path, cfg: Config) -> None:
    """keep_base records the experiment every trial starts from; a relaunch whose experiment
    changes what the trials compute is refused, as a run's restart is, and one that changes
    only limits (train.max_steps, ...) records them, as a run's restart does."""
    _check_base(sweep_dir, cfg)
    replace_text(sweep_dir / BASE, config_mod.dump(
        cfg, "the experiment every trial of this bayes sweep starts from; trial-<i>/run.yaml "
        "adds its values"))


def refresh(sweep_dir: Path, base: Config, world_size: int | None) -> None:
    """refresh rewrites the run.yaml of every trial that has its values from `base` (a
    relaunch with --set train.max_steps=N reaches the trials that started already, as a grid
    sweep's relaunch does), checked as a run's restart is."""
    for cfg, run in check_relaunch(sweep_dir, base, world_size):
        prepare_run_dir(cfg, run, rename=trials.RENAME)


def _at(cfg: Config, trial: Path) -> Config:
    """_at is `cfg` in the trial's folder where it is now: base.yaml names the folder of the
    first launch, and a sweep copied or moved elsewhere must not train in the old one."""
    here = trial.resolve()
    return dataclasses.replace(cfg, run=dataclasses.replace(
        cfg.run, storage=str(here.parent), exp_name=here.name))


def load_base(sweep_dir: Path) -> Config:
    try:
        return config_mod.load(sweep_dir / BASE)
    except ConfigError as exc:
        raise SweepError(f"{sweep_dir / BASE} (the sweep's experiment): {exc}") from None


def sweep_of(rec: record.Record) -> spec.Sweep:
    """sweep_of is the sweep as launched, from its record (which keeps the parameters)."""
    return spec.parse({"name": rec.name, "method": rec.method, "run_cap": len(rec.trials),
                       "metric": {"name": rec.metric, "goal": rec.goal},
                       "parameters": rec.parameters}, rec.name, f"{rec.name}'s sweep.yaml")


def recorded(trial_dir: Path, keys: list[str]) -> dict[str, Any] | None:
    """recorded is a trial's values from its run.yaml; None before its first start."""
    run = RunDir(trial_dir)
    if not run.config.is_file():
        return None
    try:
        return trials.resolved(config_mod.load(run.config), keys)
    except ConfigError as exc:
        raise SweepError(f"{run.config} (the trial's recorded config): {exc}") from None


def take(trial_dir: str | Path, ask: Ask, world_size: int | None = None) -> Taken:
    """take returns the trial's values: those recorded at its first start, or else the run
    `ask` gets from wandb, checked and recorded (run id, values, run.yaml last)."""
    trial = Path(trial_dir).resolve()
    rec = record.read(trial.parent)
    entry = next((t for t in rec.trials if t["dir"] == trial.name), None)
    if rec.method != "bayes" or entry is None or not rec.wandb:
        raise SweepError(f"{trial} is no trial of a bayes sweep registered with wandb")
    sweep = sweep_of(rec)
    run = RunDir(trial)
    keys = [p.key for p in sweep.params]
    values = recorded(trial, keys)
    if values is not None:  # run.yaml is the commit: wandb/ may be gone (cleaned after a sync)
        ident = run.wandb / RUN_ID_FILE
        return Taken(values, ident.read_text().strip() or None if ident.is_file() else None,
                     asked=False)
    base = load_base(trial.parent)
    got = ask(rec.wandb["sweep_id"], base)
    if not _RUN_ID.fullmatch(got.run_id):
        raise SweepError(f"wandb handed out run id {got.run_id[:80]!r}, which is no run id")
    values = check_values(sweep, got.args)
    index = int(entry["index"])
    cfg = _at(trials.trial_config(rec.name, base, index, values, world_size,
                                  f"the values wandb handed to trial {index}"), trial)
    run.create()
    run.wandb.mkdir(parents=True, exist_ok=True)
    replace_text(run.wandb / RUN_ID_FILE, got.run_id + "\n")
    replace_text(run.wandb / SWEEP_PARAMS, "wandb_version: 1\n\n" + yaml.safe_dump(
        {k: {"value": v} for k, v in values.items()}, sort_keys=False))
    write_config(cfg, run, f"values from wandb's sweep {rec.wandb['sweep_id']}, run "
                           f"{got.run_id}")
    return Taken(values, got.run_id, asked=True)
