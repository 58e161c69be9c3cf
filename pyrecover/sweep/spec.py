"""The sweep file: wandb's sweep format, read and checked before anything else happens.

    name: lr-search            # optional; default: the file's name without .yaml
    method: grid               # grid | random | bayes (bayes: tracking.wandb online)
    metric: {name: loss, goal: minimize}   # bayes: required
    run_cap: 8                 # random, bayes: how many trials (required); grid: at most this many
    max_parallel: 2            # pyrecover: tasks running at once (--array=0-N%M)
    seed: 0                    # pyrecover: seeds the random draws (default 0)
    parameters:
      train.lr: {values: [1e-3, 3e-3]}
      train.seed: {value: 1}
      train.warmup_steps: {distribution: int_uniform, min: 0, max: 20}

Pure: `parse(raw, default_name)` takes the loaded YAML and raises SweepError naming the bad
key. Whether a parameter is a config key, and its values possible, is trials.py's check;
whether a bayes sweep can reach wandb, wandb_sweep.py's.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyrecover.config_checks import short
from pyrecover.sweep import SweepError

MAX_TRIALS = 10_000
"""The most trials a sweep file may ask for: one job array, whose size SLURM caps anyway
(MaxArraySize, 1001 by default), and each trial's config built and checked at launch."""
METHODS = ("grid", "random", "bayes")
GOALS = ("minimize", "maximize")
DISTRIBUTIONS = ("categorical", "constant", "uniform", "log_uniform_values", "int_uniform",
                 "q_uniform")
METRICS = ("loss", "grad_norm", "tokens_per_s", "step_time", "mfu")
"""What metrics.jsonl records per logged step that a sweep can rank by."""
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # always fullmatch: `$` passes "x\n"
_TOP_KEYS = ("name", "method", "metric", "parameters", "run_cap", "max_parallel", "seed",
             "description", "program", "command", "project", "entity")
Scalar = str | int | float | bool
_USES = {"categorical": ("values",), "constant": ("value",), "q_uniform": ("min", "max", "q")}
_USES.update(dict.fromkeys(("uniform", "log_uniform_values", "int_uniform"), ("min", "max")))
"""The keys each distribution reads (besides `distribution`): any other is refused."""


@dataclass(frozen=True)
class Param:
    """One swept config key and how its values are chosen."""

    key: str
    distribution: str
    values: tuple[Scalar, ...] = ()
    """categorical: the choices; constant: the one value."""
    low: float = 0.0
    high: float = 0.0
    q: float = 1.0


@dataclass(frozen=True)
class Sweep:
    name: str
    method: str
    metric: str
    goal: str
    params: tuple[Param, ...]
    run_cap: int | None
    max_parallel: int | None
    seed: int
    project: str | None = None
    """wandb's project (and entity) of the sweep: every trial logs there (tracking.project)."""
    entity: str | None = None


def load(path: str | Path) -> Sweep:
    """load reads a sweep file; its name defaults to the file's stem."""
    p = Path(path)
    if p.is_dir():
        raise SweepError(f"sweep file {str(p)!r} is a folder; give the sweep's YAML file (e.g. "
                         "launch/sweeps/tiny-lr.yaml)")
    if not p.is_file():
        raise SweepError(f"sweep file {str(p)!r} does not exist")
    from pyrecover.config import ConfigError, read_yaml

    try:  # read as a config is: UTF-8, size-capped, no aliases, the bad line named
        raw = read_yaml(p, what="sweep file")
    except ConfigError as exc:
        raise SweepError(str(exc)) from None
    return parse(raw, p.stem, str(p))


def parse(raw: Any, default_name: str, source: str = "sweep") -> Sweep:
    """parse checks the sweep's grammar and returns it; raises SweepError naming the key."""
    if not isinstance(raw, dict):
        raise SweepError(f"{source}: expected a mapping with method and parameters")
    unknown = sorted(set(map(str, raw)) - set(_TOP_KEYS))
    if unknown:
        raise SweepError(f"{source}: unknown key {short(unknown[0])}; known: "
                         f"{', '.join(_TOP_KEYS)}")
    given = raw.get("name")  # absent or null: the file's name; "", a list or true: a mistake
    name = default_name if given is None else str(given)
    if isinstance(given, bool) or not isinstance(given, (str, int, type(None))) or \
            not _NAME.fullmatch(name) or ".." in name:
        shown = short(name if given is None else given)
        raise SweepError(f"{source}: name={shown} is not allowed: up to 128 letters, digits, "
                         "'.', '_' and '-', the first a letter or digit, no '..' (it names the "
                         "sweep's folder)")
    method = raw.get("method")
    if method not in METHODS:
        raise SweepError(f"{source}: method={short(method)} is not allowed: expected grid, random "
                         "or bayes")
    if method == "bayes" and raw.get("metric") is None:
        raise SweepError(f"{source}: method=bayes needs metric: {{name: loss, goal: minimize}}, "
                         "what wandb's controller optimizes")
    metric, goal = _metric(raw.get("metric"), source)
    params = raw.get("parameters")
    if not isinstance(params, dict) or not params:
        raise SweepError(f"{source}: parameters must map config keys (e.g. train.lr) to "
                         "{values: [...]}, {value: ...} or {distribution: ..., min, max}")
    parsed = tuple(_param(str(k), v, source) for k, v in params.items())
    run_cap = _count(raw, "run_cap", source)
    if method in ("random", "bayes") and run_cap is None:
        raise SweepError(f"{source}: method={method} needs run_cap, the number of trials")
    if method == "grid":
        loose = next((p for p in parsed if p.distribution not in ("categorical", "constant")),
                     None)
        if loose is not None:
            raise SweepError(f"{source}: parameters.{loose.key}: method=grid needs values or "
                             f"value, not distribution {loose.distribution}")
    trials = run_cap or 0
    if method == "grid":
        combos = math.prod(len(p.values) for p in parsed)
        trials = min(combos, run_cap) if run_cap else combos
    if trials > MAX_TRIALS:
        fewer = "run_cap or the number of values" if method == "grid" else "run_cap"
        raise SweepError(f"{source}: {trials} trials; a sweep has at most {MAX_TRIALS} (one "
                         f"SLURM array, whose MaxArraySize is often 1001): lower {fewer}")
    seed = raw.get("seed", 0)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise SweepError(f"{source}: seed={short(seed)} is not allowed: expected an integer >= 0")
    where = {}
    for key in ("project", "entity"):
        value = raw.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise SweepError(f"{source}: {key}={short(value)} is not allowed: expected wandb's "
                             f"{key} name")
        where[key] = value
    return Sweep(name=name, method=method, metric=metric, goal=goal, params=parsed,
                 run_cap=run_cap, max_parallel=_count(raw, "max_parallel", source), seed=seed,
                 **where)


def raw_param(p: Param) -> dict[str, Any]:
    """raw_param writes `p` back in the sweep file's format (parse reads it to an equal Param)."""
    if p.distribution == "categorical":
        return {"values": list(p.values)}
    if p.distribution == "constant":
        return {"value": p.values[0]}
    ints = p.distribution == "int_uniform"
    out: dict[str, Any] = {"distribution": p.distribution, "min": int(p.low) if ints else p.low,
                           "max": int(p.high) if ints else p.high}
    return {**out, "q": p.q} if p.distribution == "q_uniform" else out


def _metric(raw: Any, source: str) -> tuple[str, str]:
    if raw is None:
        return "loss", "minimize"
    if not isinstance(raw, dict) or set(raw) - {"name", "goal", "target"}:
        raise SweepError(f"{source}: metric must be {{name: loss, goal: minimize}}")
    name, goal = raw.get("name", "loss"), raw.get("goal", "minimize")
    if name not in METRICS:
        raise SweepError(f"{source}: metric.name={short(name)} is not allowed: expected one of "
                         f"{', '.join(METRICS)} (what metrics.jsonl records)")
    if goal not in GOALS:
        raise SweepError(f"{source}: metric.goal={short(goal)} is not allowed: expected minimize "
                         "or maximize")
    return name, goal


def _count(raw: dict[str, Any], key: str, source: str) -> int | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise SweepError(f"{source}: {key}={short(value)} is not allowed: expected an integer >= 1")
    return value


def _param(key: str, raw: Any, source: str) -> Param:
    where = f"{source}: parameters.{key}"
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: expected {{values: [...]}}, {{value: ...}} or "
                         "{distribution: ..., min: ..., max: ...}")
    allowed = {"values", "value", "distribution", "min", "max", "q", "probabilities"}
    extra = sorted(set(map(str, raw)) - allowed)
    if extra:
        raise SweepError(f"{where}: unknown key {short(extra[0])}; known: "
                         f"{', '.join(sorted(allowed))}")
    if "probabilities" in raw:
        raise SweepError(f"{where}: probabilities are not supported; repeat a value in values "
                         "to weigh it")
    dist = raw.get("distribution")
    if dist is None:  # wandb infers it from what is given
        dist = ("categorical" if "values" in raw else "constant" if "value" in raw else
                "int_uniform" if _all_ints(raw.get("min"), raw.get("max")) else "uniform")
    if dist not in DISTRIBUTIONS:
        raise SweepError(f"{where}: distribution={short(dist)} is not supported: expected one of "
                         f"{', '.join(DISTRIBUTIONS)}")
    unused = sorted(set(map(str, raw)) - {"distribution", *_USES[dist]})
    if unused:  # silently dropped, it would change the sweep without a word
        raise SweepError(f"{where}: {short(unused[0])} does not apply to distribution {dist} "
                         f"(it reads {', '.join(_USES[dist])}); remove it or change the "
                         "distribution")
    if dist == "categorical":
        values = raw.get("values")
        if not isinstance(values, list) or not values:
            raise SweepError(f"{where}: values must be a non-empty list")
        return Param(key, dist, tuple(_scalar(v, where) for v in values))
    if dist == "constant":
        if "value" not in raw:
            raise SweepError(f"{where}: distribution constant needs value")
        return Param(key, dist, (_scalar(raw["value"], where),))
    low, high = _number(raw, "min", where), _number(raw, "max", where)
    if not low <= high:
        raise SweepError(f"{where}: min={low!r} must not exceed max={high!r}")
    if dist == "log_uniform_values" and low <= 0:
        raise SweepError(f"{where}: log_uniform_values needs min > 0, got {low!r}")
    if dist == "int_uniform" and not _all_ints(raw["min"], raw["max"]):
        raise SweepError(f"{where}: int_uniform needs integer min and max")
    q = _number(raw, "q", where) if "q" in raw else 1.0
    if q <= 0:
        raise SweepError(f"{where}: q={q!r} must be > 0")
    far = next((k for k, x in (("max", high), ("min", low)) if not math.isfinite(x / q)), None)
    if dist == "q_uniform" and far is not None:  # round() of it: an OverflowError
        raise SweepError(f"{where}: q={q!r} is too small for min={low!r} and max={high!r} "
                         f"({far} / q is past a float's range); give a larger q")
    if dist == "q_uniform" and low < high and round(low / q) == round(high / q):
        given = f"q={q!r}" if "q" in raw else "q (default 1)"
        raise SweepError(f"{where}: q_uniform rounds to multiples of {given}, so every value "
                         f"between min={low!r} and max={high!r} is {round(low / q) * q!r}; give "
                         "a smaller q")
    return Param(key, dist, low=low, high=high, q=q)


def _all_ints(*values: Any) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in values)


def _number(raw: dict[str, Any], key: str, where: str) -> float:
    value = raw.get(key)
    if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    number = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer past float's range
            pass
    if not math.isfinite(number):
        raise SweepError(f"{where}: {key}={short(value)} is not allowed: expected a finite "
                         "number")
    return number


def _scalar(value: Any, where: str) -> Scalar:
    if not isinstance(value, (str, int, float, bool)):
        raise SweepError(f"{where}: {short(value)} is not allowed: a config value is a number, a "
                         "string or true/false")
    return value
