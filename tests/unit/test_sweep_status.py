"""Sweep status: the trials ranked by their metric, the best named, diverged and crashed
trials said as such, and a trial found in its array from inside its own folder."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, pyrecover
from sbatch_support import FIXED_CWD
from test_sweep import GRID, base_config, sweep_of

from pyrecover import config as config_mod
from pyrecover.rundir import RunDir
from pyrecover.slurm.render import absolute_paths
from pyrecover.sweep import SweepError, record, trials
from pyrecover.sweep import status as sweep_status


def fake_trial(root, index, losses, finished):
    run = RunDir(root / trials.trial_name(index))
    run.create()
    run.config.write_text(config_mod.dump(config_mod.load(TINY)))
    run.event("start", step=0)
    for step, loss in enumerate(losses, 1):
        run.metric(step=step, loss=loss)
    if finished:
        run.event("finish", step=len(losses))
        run.event("resume", step=len(losses))  # launched again: nothing to do, no restart
        run.event("finish", step=len(losses))


def test_status_ranks_trials_by_their_last_metric_and_names_the_best(tmp_path):
    sweep = sweep_of({"method": "grid", "parameters": {"train.lr": {"values": [1, 2, 3, 4]}}})
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    fake_trial(tmp_path, 0, [5.0, 3.0, 2.5], True)
    fake_trial(tmp_path, 1, [5.0, 1.0, 2.0], True)   # best value earlier, worse at the end
    fake_trial(tmp_path, 2, [4.0, 2.2], False)
    RunDir(tmp_path / "trial-2").event("resume", step=1)  # requeued once
    # trial 3 never started: ranked last
    s = sweep_status.read(tmp_path)
    assert [t.index for t in s.trials] == [1, 2, 0, 3] and s.best == 1
    assert (s.trials[0].last, s.trials[0].best, s.trials[0].state) == (2.0, 1.0, "finished")
    assert [t.restarts for t in s.trials] == [0, 1, 0, 0]
    text = sweep_status.render(s)
    assert text.splitlines()[-1].startswith("best: trial 1 (")
    done = pyrecover("sweep", "status", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["best"] == 1


def test_a_trial_that_crashed_before_its_first_checkpoint_counts_the_restart(tmp_path):
    """A trial that runs out of memory at step 1 restarts from step 0, a `start` and not a
    `resume`: the sweep table said 0 restarts where `pyrecover status` of the trial said 1."""
    sweep = sweep_of({"method": "grid", "parameters": {"train.lr": {"values": [1]}}})
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    fake_trial(tmp_path, 0, [5.0], False)
    run = RunDir(tmp_path / "trial-0")
    run.event("crash", rank=0, error="OutOfMemoryError: CUDA out of memory")
    run.event("requeue", exit_code=1, reason="crash")
    run.event("start", step=0)
    (trial,) = sweep_status.read(tmp_path).trials
    assert trial.restarts == 1


def test_a_trial_that_diverged_is_ranked_after_the_others_and_never_named_best(tmp_path):
    """An lr sweep's highest lr logs NaN losses until the guard stops it: NaN in the sort
    key made it the best trial, and `--json` printed NaN, which strict JSON refuses."""
    sweep = sweep_of({"method": "grid", "parameters": {"train.lr": {"values": [1, 2, 3]}}})
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    fake_trial(tmp_path, 0, [5.0, 3.0, float("nan")], False)
    fake_trial(tmp_path, 1, [5.0, 4.0], True)
    fake_trial(tmp_path, 2, [5.0, float("inf"), 3.5], True)  # recovered: its last counts
    s = sweep_status.read(tmp_path)
    assert [t.index for t in s.trials] == [2, 1, 0] and s.best == 2
    assert (s.trials[2].diverged, s.trials[2].last, s.trials[2].best) == (True, None, 3.0)
    assert "diverged" in sweep_status.render(s).splitlines()[-2]
    done = pyrecover("sweep", "status", str(tmp_path), "--json")
    assert done.returncode == 0, done.stderr

    def strict(token: str):
        raise ValueError(f"not JSON: {token}")
    report = json.loads(done.stdout, parse_constant=strict)
    assert report["best"] == 2 and report["trials"][2]["diverged"] is True


def test_a_trial_the_nan_guard_ended_under_finite_losses_is_diverged_not_ranked(tmp_path):
    """NaN gradients with finite losses (lr 1e5, no clipping) end a trial by
    train.max_bad_steps with a last loss of 7e9: it was ranked as a result, and by a metric
    to maximize it could have been named best."""
    from pyrecover.loop import TrainingError

    sweep = sweep_of({"method": "grid", "metric": {"name": "loss", "goal": "maximize"},
                      "parameters": {"train.lr": {"values": [1, 2]}}})
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    fake_trial(tmp_path, 0, [5.0, 7.5e9], False)
    RunDir(tmp_path / "trial-0").event("error", rank=0, error=f"{TrainingError.__name__}: 5 "
                                       "consecutive steps had a non-finite loss or gradient")
    fake_trial(tmp_path, 1, [5.0, 4.0], True)
    s = sweep_status.read(tmp_path)
    assert [(t.index, t.diverged, t.last) for t in s.trials] == [(1, False, 4.0),
                                                                  (0, True, None)]
    assert s.best == 1


def test_a_sweep_whose_every_trial_diverged_says_so_not_that_none_logged_the_metric(tmp_path):
    """Every lr too high: each trial logged losses, the last NaN. The last line said "best:
    none yet (no trial has logged loss)", which sends a person looking for a logging fault."""
    sweep = sweep_of({"method": "grid", "parameters": {"train.lr": {"values": [1, 2, 3]}}})
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    fake_trial(tmp_path, 0, [5.0, float("nan")], False)
    fake_trial(tmp_path, 1, [5.0, 4.0, float("nan")], False)
    # trial 2 never started
    lines = sweep_status.render(sweep_status.read(tmp_path)).splitlines()
    assert lines[-1] == "best: none (every trial that logged loss diverged: its last loss is " \
        "not finite)"
    empty = tmp_path / "empty"
    record.write(empty, record.make(sweep, trials.choose(sweep)))
    lines = sweep_status.render(sweep_status.read(empty)).splitlines()
    assert lines[-1] == "best: none yet (no trial has logged loss)"


def test_ranking_by_mfu_is_refused_for_cpu_trials_and_explained_where_none_is_logged(
        tmp_path):
    """MFU needs a GPU's bf16 peak: a sweep ranked by it on the CPU said "best: none yet"
    for ever."""
    sweep = sweep_of({"method": "grid", "metric": {"name": "mfu", "goal": "maximize"},
                      "parameters": {"train.lr": {"values": [1e-3, 2e-3]}}})
    cpu = absolute_paths(config_mod.load(TINY, ["run.storage=/s", "train.device=cpu"]),
                         FIXED_CWD)
    with pytest.raises(SweepError) as err:
        trials.configs(sweep, cpu, trials.choose(sweep))
    assert "metric.name='mfu': trial 0 trains on the CPU" in str(err.value)
    assert "rank by tokens_per_s" in str(err.value)
    assert len(trials.configs(sweep, base_config(), trials.choose(sweep))) == 2  # auto: a GPU
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    fake_trial(tmp_path, 0, [5.0, 4.0], False)  # logged steps, no mfu: an unknown GPU
    lines = sweep_status.render(sweep_status.read(tmp_path)).splitlines()
    assert lines[-1].startswith("best: none yet (no trial has logged mfu; mfu is logged only "
                                "on a GPU whose bf16 peak pyrecover knows")


def test_a_trial_named_from_inside_its_own_folder_is_found_in_its_array(tmp_path,
                                                                         monkeypatch):
    """`cd runs/lr-grid/trial-3 && pyrecover cancel .` said the trial had no job to cancel
    while its task waited in the array: '.' has no parent folder to find the sweep in."""
    sweep = sweep_of(GRID)
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    record.add_job(tmp_path, 4242)
    (tmp_path / "trial-3").mkdir()
    assert record.trial_task(tmp_path / "trial-3") == "4242_3"
    monkeypatch.chdir(tmp_path / "trial-3")
    assert record.trial_task(".") == "4242_3"


def test_a_finished_trial_whose_task_of_a_newer_array_waits_reads_launched_again(tmp_path):
    """The sweep launched again (a higher train.max_steps): its finished trials read
    `finished (PENDING)`, though their new tasks will train on."""
    sweep = sweep_of({"method": "grid", "parameters": {"train.lr": {"values": [1, 2]}}})
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    for index, (job, end) in enumerate([("800_0", "finish"), ("812_1", "stop")]):
        run = RunDir(tmp_path / trials.trial_name(index))
        run.create()
        run.config.write_text(config_mod.dump(config_mod.load(TINY)))
        run.event("start", step=0, job_id=job)
        run.metric(step=1, loss=3.0)
        run.event(end, step=1, job_id=job, reason="SIGUSR2")
    record.add_job(tmp_path, 812)
    states = {"812_0": "PENDING", "812_1": "PENDING"}  # 812_1: requeued after its stop
    s = sweep_status.read(tmp_path, slurm=lambda array: states if array == "812" else {})
    by_index = {t.index: t for t in s.trials}
    assert (by_index[0].state, by_index[0].slurm_state) == (
        "launched again (before: finished)", "PENDING")
    assert by_index[1].state.startswith("stopped"), by_index[1].state
    assert sweep_status.read(tmp_path).trials[0].state == "finished"  # SLURM not asked
