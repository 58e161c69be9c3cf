"""A trial whose job fails before its trainer records anything (the container does not start,
the image is missing, an import fails): each start of the job is counted, and so is each
restart, in `pyrecover status` of the trial and in `sweep status`."""

from __future__ import annotations

from pathlib import Path

from helpers import TINY
from sbatch_support import run_step
from test_sweep import GRID, array_spec, sweep_of

from pyrecover import config as config_mod
from pyrecover import status, status_text
from pyrecover.rundir import RunDir
from pyrecover.slurm.render import render
from pyrecover.sweep import record, trials
from pyrecover.sweep import status as sweep_status


def _a_sweep(storage: Path) -> Path:
    """The sweep array_spec renders the array of, recorded as `sweep launch` records it."""
    sweep = sweep_of({**GRID, "max_parallel": 2}, "lr-grid")
    root = storage / "lr-grid"
    record.write(root, record.make(sweep, trials.choose(sweep)))
    for t in record.read(root).trials:
        run = RunDir(root / t["dir"])
        run.create()
        run.config.write_text(config_mod.dump(config_mod.load(TINY)))
    return root


def test_a_trial_whose_job_fails_before_the_trainer_starts_counts_its_restarts(tmp_path):
    """Task 4's container failed at both its starts (exit 1), the job script requeuing it
    each time: `sweep status` read 'not started' and 0 restarts, status 'starts 0'."""
    storage = tmp_path / "storage"
    root = _a_sweep(storage)
    script = render(array_spec(str(storage), launcher="none"))
    for restart in range(2):  # the job's first start and its requeue's
        _, stderr, code = run_step(script, tmp_path, exit_code=1, env={
            "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "4",
            "SLURM_RESTART_COUNT": str(restart)})
        assert code in (0, 1), stderr
    trial = root / trials.trial_name(4)
    assert [e["event"] for e in RunDir(trial).read_events()] == ["requeue", "requeue"]
    s = status.read(trial)
    assert s.starts == 2
    assert s.restarts_by_cause == {"failed before the trainer started": 1}
    assert "starts      2: restarts 1 x failed before the trainer started" in \
        status_text.render(s)
    assert s.state == "failed before the trainer started (requeued)"
    (row,) = [t for t in sweep_status.read(root).trials if t.index == 4]
    assert row.restarts == 1 and row.state == s.state


def test_a_bayes_trial_that_never_got_its_values_counts_its_restarts(tmp_path, monkeypatch):
    """wandb could not be asked at the task's first starts (exit 1 before training, the job
    requeuing it): the bayes trial's row read 0 restarts, whatever its task had been
    through."""
    from test_sweep_bayes import launched

    _, sweep_dir = launched(tmp_path)
    trial = RunDir(sweep_dir / "trial-0")
    trial.create()
    monkeypatch.setenv("SLURM_JOB_ID", "121")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "120")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "0")
    for restart in range(3):  # as the job script records them (slurm/blocks.py)
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        trial.event("requeue", exit_code=1, reason="crash", time=10.0 * (restart + 1))
    (row,) = [t for t in sweep_status.read(sweep_dir).trials if t.index == 0]
    assert row.restarts == 2
    assert row.state == f"{status.TRAINERLESS} (requeued), {sweep_status.NO_VALUES}"
