"""The sweep's job array: the single-run script of pyrecover.slurm.render with `--array`.

Task i runs trial i: `--config <sweep dir>/trial-$SLURM_ARRAY_TASK_ID/run.yaml`, its log in
that trial's `logs/`, its events there, and on a stop or a crash it requeues only itself
(`scontrol requeue ARRAYID_TASKID`), with its own SLURM_RESTART_COUNT. A bayes task runs
`pyrecover sweep values <trial dir>` before its first step. Pure.
"""

from __future__ import annotations

import dataclasses

from pyrecover.config import Config
from pyrecover.slurm import render
from pyrecover.slurm.profile import ClusterProfile
from pyrecover.slurm.render import ArrayJob, JobSpec
from pyrecover.sweep.trials import TRIAL_PREFIX


def indices(trials: int, max_parallel: int | None) -> str:
    """indices is sbatch's --array value: `0-N` and `%M` to run at most M at once. A limit
    above the trial count limits nothing: it is the trial count (sbatch refuses a huge M)."""
    return f"0-{trials - 1}" + (f"%{min(max_parallel, trials)}" if max_parallel else "")


def array_spec(base: Config, profile: ClusterProfile, python: str, trials: int,
               max_parallel: int | None, bayes: bool = False) -> JobSpec:
    """array_spec is the JobSpec of the sweep: `base`'s run dir is the sweep's folder. A
    bayes task first gets its trial's values (`pyrecover sweep values`, pyrecover.sweep.bayes)."""
    spec = render.job_spec(base, profile, python)
    setup = ("sweep", "values", "--world-size", str(profile.nodes * profile.gpus_per_node)) \
        if bayes else ()
    return dataclasses.replace(spec, array=ArrayJob(indices(trials, max_parallel),
                                                    TRIAL_PREFIX, setup))


def script(spec: JobSpec) -> str:
    return render.render(spec)
