"""`pyrecover sweep status SWEEP_DIR`: every trial read back from its run directory, ranked.

Trials are ranked by the last logged value of the sweep's metric (the final loss of a finished
trial), best first; trials that logged nothing yet come last. A bayes trial's values are read
from its run.yaml; before its first start it has none ("no values yet"). Nothing here writes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pyrecover import status as run_status
from pyrecover.rundir import RunDir, read_jsonl
from pyrecover.sweep import SweepError, bayes, record

DIVERGED_ERROR = "TrainingError:"
"""How the error of a run that train.max_bad_steps ended begins (loop.TrainingError; not
imported: it would import torch into `sweep status`)."""
NO_VALUES = "no values yet"
"""A bayes trial's state before wandb handed it its values (at its first start)."""


@dataclass
class Trial:
    index: int
    run_dir: str
    params: dict[str, Any]
    state: str
    slurm_state: str | None
    step: int
    max_steps: int | None
    restarts: int
    last: float | None
    best: float | None
    diverged: bool = False
    """The metric's last logged value was not finite (NaN, inf): `last` is None then."""


@dataclass
class SweepStatus:
    sweep_dir: str
    name: str
    method: str
    metric: str
    goal: str
    trials: list[Trial]
    """Ranked by `last`, best first."""
    best: int | None
    """The best trial's index: the first of `trials` when it logged the metric."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def read(sweep_dir: str | Path, slurm: Callable[[str], dict[str, str]] | None = None
         ) -> SweepStatus:
    """read builds the SweepStatus; `slurm(array_id)` (optional) maps the array's tasks,
    ARRAYID_TASKID, to their SLURM states (query.array_states: two calls for the sweep)."""
    rec = record.read(sweep_dir)
    root = Path(sweep_dir)
    array = record.last_job(root)
    keys = list(rec.parameters or {})
    # ARRAYID_TASKID: one task's SLURM_JOB_ID may be the whole array's id
    states = slurm(array) if slurm and array else {}
    trials = [_trial(root / t["dir"], int(t["index"]), t["params"] if t["params"] is not None
                     else _recorded(root / t["dir"], keys), rec, f"{array}_{t['index']}",
                     states)
              for t in rec.trials]
    sign = 1.0 if rec.goal == "minimize" else -1.0
    # Those with a last value first (best first), then the diverged ones, then the rest.
    trials.sort(key=lambda t: (0 if t.last is not None else 1 if t.diverged else 2,
                               sign * t.last if t.last is not None else 0.0, t.index))
    best = trials[0].index if trials and trials[0].last is not None else None
    return SweepStatus(sweep_dir=str(root), name=rec.name, method=rec.method,
                       metric=rec.metric, goal=rec.goal, trials=trials, best=best)


def _recorded(path: Path, keys: list[str]) -> dict[str, Any] | str | None:
    """_recorded is a bayes trial's values from its run.yaml, None before its first start, or
    what is wrong with a run.yaml that does not read (one trial's, not the table's end)."""
    try:
        return bayes.recorded(path, keys)
    except SweepError as exc:
        return f"unreadable: {str(exc).replace(f'{path}{os.sep}', '')}"


def _trial(path: Path, index: int, params: dict[str, Any] | str | None, rec: record.Record,
           task: str, states: dict[str, str]) -> Trial:
    """_trial reads one trial; `task` is its task's name in the sweep's newest array, whose
    tasks' SLURM states are `states`: a trial that had ended and whose task of a newer array
    waits reads `launched again`, as a run does (status.read)."""
    run = RunDir(path)
    slurm_state = states.get(task)
    if isinstance(params, str):  # _recorded's problem
        return Trial(index, str(path), {}, params, slurm_state, 0, None, 0, None, None)
    if params is None:  # bayes: wandb hands the values out at the trial's first start
        # A task that ended or failed without them (values refused, wandb unreachable,
        # cancelled) has the job's records: its state and its restarts.
        s = run_status.read(path) if run.problem() is None else None
        ended = s.state if s is not None else "not started"
        state = NO_VALUES if ended == "not started" else f"{ended}, {NO_VALUES}"
        return Trial(index, str(path), {}, state, slurm_state, 0, None,
                     _restarts(s) if s is not None else 0, None, None)
    params = dict(params)
    values = [v for v in (_number(m.get(rec.metric)) for m in read_jsonl(run.metrics))
              if v is not None]
    finite = [v for v in values if math.isfinite(v)]
    if run.problem() is not None:  # written at launch; gone only if someone removed it
        return Trial(index, str(path), params, "missing", slurm_state, 0, None, 0, None, None)
    s = run_status.read(path, squeue=states.get, task=task) if states else run_status.read(path)
    best = (min(finite) if rec.goal == "minimize" else max(finite)) if finite else None
    # NaN gradients under finite losses end a trial too (train.max_bad_steps): its last loss
    # (say 7e9) is no result, and ranked by tokens_per_s it could have been named best.
    diverged = (bool(values) and not math.isfinite(values[-1])) or \
        str(s.last_error).startswith(DIVERGED_ERROR)
    return Trial(index=index, run_dir=str(path), params=params, state=s.state,
                 slurm_state=slurm_state, step=s.step, max_steps=s.max_steps,
                 restarts=_restarts(s),
                 last=values[-1] if values and not diverged else None,
                 best=best, diverged=diverged)


def _restarts(s: run_status.Status) -> int:
    """_restarts: the trial's restarts, every cause but a finished run continued."""
    return sum(n for cause, n in s.restarts_by_cause.items() if cause != run_status.CONTINUED)


def _number(value: Any) -> float | None:
    """_number: a logged metric as a float (None for a missing or hand-edited one)."""
    if type(value) in (int, float):
        return float(value)
    return None


def render(s: SweepStatus) -> str:
    """render is the table a person reads: one line per trial, best first."""
    keys = sorted({k for t in s.trials for k in t.params})
    head = ["#", *keys, "state", "step", "restarts", f"last {s.metric}", f"best {s.metric}"]
    rows = [[str(t.index), *(_fmt(t.params.get(k)) for k in keys),
             t.state + (f" ({t.slurm_state})" if t.slurm_state else ""),
             f"{t.step}/{t.max_steps}" if t.max_steps else str(t.step), str(t.restarts),
             "diverged" if t.diverged else _fmt(t.last), _fmt(t.best)] for t in s.trials]
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"sweep {s.name} ({s.method}, {s.goal} {s.metric}): {s.sweep_dir}",
             *("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
               for r in [head, *rows])]
    if s.method == "bayes":
        lines.append("values: from wandb's bayes controller at each trial's first start "
                     f"('-' and {NO_VALUES!r}: not started yet, or ended before it got them)")
    if s.best is None and any(t.diverged for t in s.trials):
        lines.append(f"best: none (every trial that logged {s.metric} diverged: its last "
                     f"{s.metric} is not finite)")
    elif s.best is None:
        why = ("; mfu is logged only on a GPU whose bf16 peak pyrecover knows "
               "(pyrecover/flops.py), never on the CPU"
               if s.metric == "mfu" and any(t.step for t in s.trials) else "")
        lines.append(f"best: none yet (no trial has logged {s.metric}{why})")
    else:
        top = s.trials[0]
        where = "" if top.state == "finished" else f" at step {top.step}, not finished"
        lines.append(f"best: trial {top.index} ({top.run_dir}), {s.metric} {_fmt(top.last)}"
                     f"{where}")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
