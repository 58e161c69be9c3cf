"""Sweeps: the sweep file's grammar and errors, grid expansion, seeded random draws inside
their distributions, each trial a validated config in its own folder, the job array script
(golden, shellcheck, hostile paths through a real bash). The trials ranked by status:
test_sweep_status.py."""

from __future__ import annotations

import math
import random

import pytest
import yaml
from helpers import TINY, default_cluster, pyrecover
from sbatch_support import FIXED_CWD, HOSTILE, PYTHON, check_golden, run_step, shellcheck

from pyrecover import config as config_mod
from pyrecover.rundir import RunDir
from pyrecover.slurm import profile
from pyrecover.slurm.render import absolute_paths, render
from pyrecover.sweep import SweepError, record, spec, trials
from pyrecover.sweep import render as sweep_render

GRID = {"method": "grid", "parameters": {"train.lr": {"values": [1e-3, 3e-3, 1e-2]},
                                         "train.seed": {"values": [1, 2]},
                                         "model.n_layer": {"value": 2}}}
RANDOM = {"method": "random", "run_cap": 40, "seed": 7, "parameters": {
    "train.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
    "train.weight_decay": {"distribution": "uniform", "min": 0.0, "max": 0.2},
    "train.warmup_steps": {"distribution": "int_uniform", "min": 0, "max": 3},
    "train.grad_clip": {"distribution": "q_uniform", "min": 0.5, "max": 2.0, "q": 0.25},
    "model.n_embd": {"values": [64, 128]}}}


def sweep_of(raw: dict, name: str = "s") -> spec.Sweep:
    return spec.parse(raw, name)


def base_config(storage: str = "/scratch/pyrecover") -> config_mod.Config:
    cfg = absolute_paths(config_mod.load(TINY, [f"run.storage={storage}"]), FIXED_CWD)
    return cfg


# ------------------------------------------------------------------ grammar and expansion


def test_a_grid_has_one_trial_per_combination_the_last_parameter_varying_fastest():
    chosen = trials.choose(sweep_of(GRID))
    assert len(chosen) == 3 * 2 * 1
    assert [(c["train.lr"], c["train.seed"]) for c in chosen] == [
        (1e-3, 1), (1e-3, 2), (3e-3, 1), (3e-3, 2), (1e-2, 1), (1e-2, 2)]
    assert trials.choose(sweep_of({**GRID, "run_cap": 4})) == chosen[:4]


@pytest.mark.parametrize("seed", range(20))
def test_random_draws_are_reproducible_and_inside_their_distributions(seed):
    sweep = sweep_of({**RANDOM, "seed": seed})
    chosen = trials.choose(sweep)
    assert chosen == trials.choose(sweep_of({**RANDOM, "seed": seed}))
    assert len(chosen) == 40
    for c in chosen:
        assert 1e-4 <= c["train.lr"] <= 1e-2
        assert 0.0 <= c["train.weight_decay"] <= 0.2
        assert c["train.warmup_steps"] in range(0, 4) and isinstance(c["train.warmup_steps"], int)
        assert 0.5 <= c["train.grad_clip"] <= 2.0
        assert math.isclose(c["train.grad_clip"] / 0.25, round(c["train.grad_clip"] / 0.25))
        assert c["model.n_embd"] in (64, 128)
    assert trials.choose(sweep_of({**RANDOM, "seed": seed + 100})) != chosen


def test_log_uniform_draws_spread_evenly_over_the_decades():
    p = spec.Param("train.lr", "log_uniform_values", low=1e-5, high=1e-1)
    rng = random.Random(0)
    decades = [int(-math.log10(trials.draw(p, rng))) for _ in range(4000)]
    counts = [decades.count(d) for d in (1, 2, 3, 4)]
    assert min(counts) > 800, counts  # 1000 each when even


@pytest.mark.parametrize("change, message", [
    ({"method": "bayes", "run_cap": 2}, "method=bayes needs metric: {name: loss, goal: "
                                        "minimize}, what wandb's controller optimizes"),
    ({"method": "bayes", "metric": {"name": "loss"}}, "method=bayes needs run_cap"),
    ({"method": "hyperband"}, "method='hyperband' is not allowed"),
    ({"method": "random"}, "method=random needs run_cap"),
    ({"parameters": {}}, "parameters must map config keys"),
    ({"parameters": {"train.lr": {"distribution": "uniform", "min": 0.1, "max": 0.2}}},
     "method=grid needs values or value"),
    ({"parameters": {"train.lr": [1, 2]}}, "parameters.train.lr: expected {values"),
    ({"parameters": {"train.lr": {"values": []}}}, "values must be a non-empty list"),
    ({"parameters": {"train.lr": {"values": [[1]]}}}, "a config value is a number"),
    ({"parameters": {"train.lr": {"valuez": [1]}}}, "unknown key 'valuez'"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "distribution": "normal", "mu": 0}}}, "unknown key 'mu'"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "distribution": "normal"}}}, "distribution='normal' is not supported"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "min": 0.2, "max": 0.1}}}, "min=0.2 must not exceed max=0.1"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "distribution": "log_uniform_values", "min": 0, "max": 1}}}, "needs min > 0"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "distribution": "q_uniform", "min": 1e-4, "max": 1e-2}}},
     "q_uniform rounds to multiples of q (default 1), so every value between min=0.0001 and "
     "max=0.01 is 0.0; give a smaller q"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "distribution": "q_uniform", "min": 1e-3, "max": 2e-3, "q": 0.1}}},
     "multiples of q=0.1, so every value"),
    ({"run_cap": 0}, "run_cap=0 is not allowed"),
    ({"max_parallel": "2"}, "max_parallel='2' is not allowed"),
    ({"metric": {"name": "val_loss"}}, "metric.name='val_loss' is not allowed"),
    ({"metric": {"name": "loss", "goal": "lowest"}}, "metric.goal='lowest'"),
    ({"name": "a/b"}, "name='a/b' is not allowed"),
    ({"name": "ab\n"}, "name='ab\\n' is not allowed"),  # `$` alone lets a newline end it
    ({"name": ""}, "name='' is not allowed"),  # not the file's name in silence
    ({"name": ["a"]}, "name=['a'] is not allowed"),
    ({"name": True}, "name=True is not allowed"),
    # Every character of these is allowed: the message says what else a name must be.
    ({"name": ".."}, "name='..' is not allowed: up to 128 letters, digits, '.', '_' and '-', "
                     "the first a letter or digit, no '..'"),
    ({"name": "-x"}, "name='-x' is not allowed: up to 128 letters, digits, '.', '_' and '-', "
                     "the first a letter or digit"),
    ({"early_terminate": {}}, "unknown key 'early_terminate'"),
    # A key the distribution does not read would be dropped without a word: refused.
    ({"parameters": {"train.lr": {"values": [1e-3], "value": 2e-3}}},
     "parameters.train.lr: 'value' does not apply to distribution categorical (it reads values)"),
    ({"parameters": {"train.lr": {"values": [1e-3], "min": 0.1, "max": 1}}},
     "'max' does not apply to distribution categorical"),
    ({"parameters": {"train.lr": {"distribution": "constant", "value": 1, "values": [2]}}},
     "'values' does not apply to distribution constant (it reads value)"),
    ({"method": "random", "run_cap": 2, "parameters": {"train.lr": {
        "distribution": "uniform", "min": 1e-3, "max": 1e-2, "q": 1e-3}}},
     "'q' does not apply to distribution uniform (it reads min, max)"),
])
def test_a_bad_sweep_file_is_refused_naming_the_key(change, message):
    with pytest.raises(SweepError, match=".*") as err:
        sweep_of({**GRID, **change})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_folder_or_a_missing_file_given_as_the_sweep_file_says_which(tmp_path):
    with pytest.raises(SweepError, match="is a folder; give the sweep's YAML file"):
        spec.load(tmp_path)
    with pytest.raises(SweepError, match="does not exist"):
        spec.load(tmp_path / "nope.yaml")


def test_min_and_max_without_a_distribution_infer_it_as_wandb_does():
    sweep = sweep_of({"method": "random", "run_cap": 1, "parameters": {
        "train.warmup_steps": {"min": 0, "max": 5}, "train.lr": {"min": 1e-4, "max": 1e-3}}})
    assert [p.distribution for p in sweep.params] == ["int_uniform", "uniform"]


# -------------------------------------------------------------- trials against the config


def test_each_trial_is_a_checked_config_in_its_own_folder_of_the_sweep():
    sweep = sweep_of({"name": "lr", "method": "grid", "parameters": {
        "train.lr": {"values": ["1e-3", 0.002]}}})  # YAML 1.1 reads 1e-3 as a string
    cfgs = trials.configs(sweep, trials.base_for(sweep, base_config()), trials.choose(sweep))
    assert [str(c.run_dir()) for c in cfgs] == ["/scratch/pyrecover/lr/trial-0",
                                                "/scratch/pyrecover/lr/trial-1"]
    assert [trials.resolved(c, ["train.lr"]) for c in cfgs] == [{"train.lr": 0.001},
                                                                {"train.lr": 0.002}]
    assert {(c.tracking.group, c.tracking.name) for c in cfgs} == {
        ("lr", "lr-trial-0"), ("lr", "lr-trial-1")}
    named = absolute_paths(config_mod.load(TINY, ["run.storage=/scratch/pyrecover",
                                                  "tracking.name=try", "tracking.group=g"]),
                           FIXED_CWD)
    cfgs = trials.configs(sweep, trials.base_for(sweep, named), trials.choose(sweep))
    assert [(c.tracking.group, c.tracking.name) for c in cfgs] == [
        ("g", "try-trial-0"), ("g", "try-trial-1")]  # a name given: still one per trial


@pytest.mark.parametrize("params, message", [
    ({"train.lrr": {"values": [1]}}, "parameters.train.lrr: unknown config key; known under "
                                     "train: max_steps"),
    ({"trian.lr": {"values": [1]}}, "parameters.trian.lr: not a config key"),
    ({"lr": {"values": [1]}}, "parameters.lr: not a config key"),
    ({"run.exp_name": {"values": ["x"]}}, "parameters.run.exp_name: the sweep sets it"),
    # One array script signals every trial: a trial waiting for USR1 was killed by USR2.
    ({"run.stop_signal": {"values": ["USR1", "USR2"]}},
     "parameters.run.stop_signal: the job array sends every trial the experiment's stop "
     "signal (USR2)"),
    ({"train.lr": {"values": [1e-3, 1e-5]}},
     "trial 1 (train.lr=1e-05): train.min_lr=0.0001 is not allowed"),
    ({"model.n_layer": {"values": [2, "two"]}}, "trial 1 (model.n_layer=two): model.n_layer="),
    ({"train.global_batch_size": {"values": [8, 6]}},
     "trial 1 (train.global_batch_size=6): train.global_batch_size=6 is not allowed"),
])
def test_an_unknown_key_or_impossible_value_names_the_trial_and_the_key(params, message):
    sweep = sweep_of({"method": "grid", "parameters": params})
    with pytest.raises(SweepError) as err:
        trials.configs(sweep, base_config(), trials.choose(sweep), world_size=2)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("option, message", [
    (["--set", "train.lr=0.1"], "--set train.lr: s.yaml sweeps it, so every trial would "
                                "replace it"),
    (["--set", " train.seed = 3"], "--set train.seed: s.yaml sweeps it"),
    (["--set", "run.exp_name=x"], "--set run.exp_name: the sweep's name names its folder (s); "
                                  "set name: in s.yaml instead"),
    (["--mode", "memory"], "--mode (checkpoint.mode): s.yaml sweeps it"),
    (["--set", "tracking.project=mine"], "--set tracking.project: s.yaml names project: "
                                         "theirs, where every trial logs"),
    (["--set", "tracking.entity=me"], "--set tracking.entity: s.yaml names entity: team"),
])
def test_a_set_no_trial_would_keep_is_one_line_exit_2_and_writes_nothing(tmp_path, option,
                                                                         message):
    """A --set of a swept key (or of the run's name) was dropped without a word: every trial
    ran with its own value. So was --mode where the sweep sweeps checkpoint.mode, and a
    --set tracking.project where the sweep file names its project."""
    swept = {**GRID["parameters"], "checkpoint.mode": {"values": ["vanilla", "dcp"]}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({**GRID, "parameters": swept,
                                                     "project": "theirs", "entity": "team"}))
    done = pyrecover("sweep", "launch", "s.yaml", "--config", str(TINY), *option,
                     "--set", f"run.storage={tmp_path / 'st'}", "--dry-run", cwd=tmp_path,
                     env=default_cluster(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "st").exists()


def test_relaunching_records_the_same_trials_and_refuses_other_ones(tmp_path):
    sweep = sweep_of(GRID)
    rec = record.make(sweep, trials.choose(sweep))
    record.write(tmp_path, rec)
    record.write(tmp_path, rec)
    assert record.read(tmp_path) == rec
    other = record.make(sweep_of({**GRID, "run_cap": 2}), trials.choose(sweep)[:2])
    with pytest.raises(SweepError, match="with other trials"):
        record.write(tmp_path, other)


@pytest.mark.parametrize("entry", [{"index": 0}, {"index": 0, "dir": "trial-0"}, 3,
                                   {"index": "0", "dir": "trial-0", "params": {}},
                                   {"index": 0, "dir": "../../etc", "params": {"a": 1}},
                                   {"index": 0, "dir": "trial-0", "params": [1]}])
def test_a_damaged_trial_in_sweep_yaml_is_one_line_exit_2_not_a_traceback(tmp_path, entry):
    """A hand-edited sweep.yaml whose trial lacked its folder made `sweep status` print
    KeyError: 'dir' as a traceback; one naming another folder read a run outside the sweep."""
    sweep = sweep_of(GRID)
    record.write(tmp_path, record.make(sweep, trials.choose(sweep)))
    raw = yaml.safe_load((tmp_path / record.RECORD).read_text())
    (tmp_path / record.RECORD).write_text(yaml.safe_dump({**raw, "trials": [entry]}))
    done = pyrecover("sweep", "status", str(tmp_path))
    assert done.returncode == 2 and done.stderr.strip() == (
        f"error: {tmp_path / record.RECORD} is damaged: not the record `sweep launch` wrote")


# ---------------------------------------------------------------------- the job array


def array_spec(storage: str = "/scratch/pyrecover", launcher: str = "srun"):
    sweep = sweep_of({**GRID, "max_parallel": 2}, "lr-grid")
    prof = profile.ClusterProfile(partition="gpu", time="1-00:00", nodes=2, cpus_per_task=8,
                                  image="/images/pyrecover.sif", launcher=launcher)
    profile.validate(prof)
    base = trials.base_for(sweep, base_config(storage))
    return sweep_render.array_spec(base, prof, PYTHON, 6, sweep.max_parallel)


def test_the_array_script_matches_its_golden_file_and_shellcheck(tmp_path):
    script = render(array_spec())
    check_golden("sweep-array.sbatch", script)
    assert "#SBATCH --array=0-5%2" in script.splitlines()
    shellcheck(script, tmp_path)


def test_each_task_trains_its_own_trial_and_requeues_only_itself(tmp_path):
    storage = tmp_path / f"storage {HOSTILE}"
    spec_ = array_spec(str(storage), launcher="none")
    trial = storage / "lr-grid" / "trial-4"
    trial.mkdir(parents=True)
    argv, stderr, code = run_step(render(spec_), tmp_path, exit_code=75, env={
        "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "4"})
    assert code == 75, stderr
    assert argv[-2:] == ["--config", f"{trial}/run.yaml"]
    assert (tmp_path / "scontrol.requeue").read_text().split() == ["120_4"]
    (event,) = RunDir(trial).read_events()
    assert (event["event"], event["job_id"]) == ("requeue", "123")
    assert not list(tmp_path.rglob("pwned"))
    shellcheck(render(spec_), tmp_path, "SC2016")


def test_a_hostile_parameter_value_stays_in_run_yaml_and_never_reaches_the_script():
    sweep = sweep_of({"name": "tags", "method": "grid", "parameters": {
        "tracking.tags": {"values": [HOSTILE, "plain"]}}})
    base = trials.base_for(sweep, base_config())
    (cfg, _) = trials.configs(sweep, base, trials.choose(sweep))
    assert config_mod.from_dict(yaml.safe_load(config_mod.dump(cfg))).tracking.tags == HOSTILE
    prof = profile.ClusterProfile(launcher="none")
    assert "pwned" not in render(sweep_render.array_spec(base, prof, PYTHON, 2, None))
