"""The sweep directory and its record, `sweep.yaml`: what was launched, trial by trial.

    <storage>/<sweep name>/
      sweep.yaml       name, method, metric, seed, the wandb sweep (when registered), and
                       each trial's folder and values (bayes: none; the parameters instead,
                       and each trial's values in its run.yaml once wandb handed them out)
      base.yaml        bayes: the experiment every trial starts from (bayes.py)
      job.sbatch       the job array's script
      jobs             the array's job id, one line per submission
      trial-<i>/       one ordinary run directory per trial (run.yaml, events.jsonl, ...)

Launching the same sweep again resubmits the same trials (each resumes from its own run
directory); a sweep file that now gives other trials is refused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pyrecover.rundir import SWEEP_RECORD, RunDir, replace_text
from pyrecover.sweep import SweepError
from pyrecover.sweep.spec import Sweep, raw_param
from pyrecover.sweep.trials import trial_name

RECORD = SWEEP_RECORD
JOBS = "jobs"


@dataclass(frozen=True)
class Record:
    name: str
    method: str
    metric: str
    goal: str
    seed: int
    trials: list[dict[str, Any]]
    """[{index, dir, params}] in trial order; params None: a bayes trial's (in its run.yaml)."""
    wandb: dict[str, Any] | None = None
    """{sweep_id, url} of the sweep registered with wandb at the first launch, else None."""
    parameters: dict[str, Any] | None = None
    """bayes: the sweep file's parameters, which each trial's values are checked against."""


def make(sweep: Sweep, params: list[dict[str, Any] | None]) -> Record:
    """make is the record of `sweep`'s trials; a bayes trial's params are None (unknown)."""
    parameters = {p.key: raw_param(p) for p in sweep.params} if sweep.method == "bayes" \
        else None
    return Record(name=sweep.name, method=sweep.method, metric=sweep.metric, goal=sweep.goal,
                  seed=sweep.seed, trials=[{"index": i, "dir": trial_name(i), "params": p}
                                           for i, p in enumerate(params)],
                  parameters=parameters)


def to_yaml(record: Record) -> str:
    wandb = {"wandb": record.wandb} if record.wandb else {}
    parameters = {"parameters": record.parameters} if record.parameters else {}
    return yaml.safe_dump({"name": record.name, "method": record.method,
                           "metric": {"name": record.metric, "goal": record.goal},
                           "seed": record.seed, **wandb, **parameters, "trials": record.trials},
                          sort_keys=False)


def read(sweep_dir: str | Path) -> Record:
    """read loads `sweep.yaml`; raises SweepError when the folder is no sweep."""
    path = Path(sweep_dir) / RECORD
    if not Path(sweep_dir).is_dir():
        what = "is a file, not a folder" if Path(sweep_dir).exists() else "does not exist"
        raise SweepError(f"sweep directory {str(sweep_dir)!r} {what}")
    if not path.is_file():
        if (Path(sweep_dir).parent / RECORD).is_file():  # a trial: one run of the sweep
            raise SweepError(f"{sweep_dir} is a trial of sweep {Path(sweep_dir).parent}, a run: "
                             f"`pyrecover status {sweep_dir}` shows it, `pyrecover sweep "
                             f"status {Path(sweep_dir).parent}` the sweep")
        raise SweepError(f"{sweep_dir} is not a sweep directory (no {RECORD}); it is "
                         "<run.storage>/<sweep name> of a `pyrecover sweep launch`")
    try:
        raw = yaml.safe_load(path.read_text())
        return Record(name=raw["name"], method=raw["method"], metric=raw["metric"]["name"],
                      goal=raw["metric"]["goal"], seed=int(raw["seed"]),
                      trials=_trials(raw["trials"]), wandb=_wandb(raw.get("wandb")),
                      parameters=_parameters(raw.get("parameters")))
    except (yaml.YAMLError, KeyError, TypeError, ValueError):
        raise SweepError(f"{path} is damaged: not the record `sweep launch` wrote") from None


def _trials(raw: Any) -> list[dict[str, Any]]:
    """_trials checks each trial as `make` writes it: its index, its folder trial-<index>
    (never another one), its values or None."""
    if not isinstance(raw, list):
        raise TypeError("trials: expected a list")
    for t in raw:
        index = t.get("index") if isinstance(t, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or \
                t.get("dir") != trial_name(index) or \
                not isinstance(t.get("params", ()), (dict, type(None))):
            raise TypeError(f"trials: {str(t)[:80]} is not {{index, dir, params}}")
    return raw


def _wandb(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("sweep_id"), str):
        raise TypeError("wandb: expected {sweep_id, url}")
    return {"sweep_id": raw["sweep_id"], "url": raw.get("url")}


def _parameters(raw: Any) -> dict[str, Any] | None:
    if raw is not None and not isinstance(raw, dict):
        raise TypeError("parameters: expected a mapping")
    return raw


def check(sweep_dir: Path, record: Record) -> bool:
    """check refuses (SweepError) what `write` would refuse, writing nothing (`sweep launch
    --dry-run` asks it too): a run's folder, or a sweep of the same name with other trials.
    True where the same sweep is recorded already."""
    if (sweep_dir / RECORD).is_file():
        old = read(sweep_dir)
        if (old.trials, old.method, old.parameters) != (record.trials, record.method,
                                                        record.parameters):
            raise SweepError(f"{sweep_dir} holds sweep {old.name!r} with other trials; give "
                             "this sweep another name (name: in the sweep file)")
        if record.method == "bayes" and (old.metric, old.goal) != (record.metric, record.goal):
            raise SweepError(f"{sweep_dir} holds sweep {old.name!r}, whose trials wandb's "
                             f"controller chooses to {old.goal} {old.metric}; give this sweep "
                             "another name (name: in the sweep file) to optimize another metric")
        return True
    if RunDir(sweep_dir).is_run():  # a run's folder: its job script and lock would be shared
        raise SweepError(f"{sweep_dir} holds a run (run.yaml, events.jsonl or checkpoints), "
                         "not a sweep; give this sweep another name (name: in the sweep file)")
    return False


def write(sweep_dir: Path, record: Record) -> str | None:
    """write records the sweep, or checks that a relaunch has the same trials. A grid or
    random relaunch may rank by another metric (it only orders `sweep status`): recorded,
    and said in the note returned."""
    path = sweep_dir / RECORD
    if check(sweep_dir, record):
        old = read(sweep_dir)
        if (old.metric, old.goal) == (record.metric, record.goal):
            return None
        replace_text(path, to_yaml(dataclasses.replace(old, metric=record.metric,
                                                       goal=record.goal)))
        return (f"note: sweep status now ranks the trials to {record.goal} {record.metric} "
                f"(was: {old.goal} {old.metric})")
    sweep_dir.mkdir(parents=True, exist_ok=True)
    replace_text(path, to_yaml(record))
    return None


def add_job(sweep_dir: Path, job_id: int) -> None:
    """add_job records a submission of the array; the last one is the live one."""
    with (sweep_dir / JOBS).open("a") as f:
        f.write(f"{job_id}\n")


def last_job(sweep_dir: str | Path) -> str | None:
    """last_job is the array's job id of the newest submission, if any."""
    path = Path(sweep_dir) / JOBS
    lines = path.read_text().split() if path.is_file() else []
    return lines[-1] if lines else None


def trial_task(trial_dir: str | Path) -> str | None:
    """trial_task is how SLURM names trial `trial_dir`'s task in its sweep's newest array
    (ARRAYID_INDEX), also before the task has started and written anything; None when the
    folder is no trial of a launched sweep."""
    trial = Path(trial_dir).absolute()  # ('.' from inside the trial: its parent is the sweep)
    sweep_dir = trial.parent
    array = last_job(sweep_dir) if (sweep_dir / RECORD).is_file() else None
    if array is None:
        return None
    try:
        index = next(t["index"] for t in read(sweep_dir).trials if t["dir"] == trial.name)
    except (SweepError, StopIteration):
        return None
    return f"{array}_{index}"
