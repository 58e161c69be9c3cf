"""Sweeps: the sweep file's grammar and errors, grid expansion, seeded random draws inside
their distributions, each trial a validated config in its own folder, the job array script
(golden, shellcheck, hostile paths through a real bash), and the trials ranked by status."""

from __future__ import annotations

import json
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
from pyrecover.sweep import status as sweep_status

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
    ({"run_cap": 0}, "run_cap=0 is not allowed"),
    ({"max_parallel": "2"}, "max_parallel='2' is not allowed"),
    ({"metric": {"name": "val_loss"}}, "metric.name='val_loss' is not allowed"),
    ({"metric": {"name": "loss", "goal": "lowest"}}, "metric.goal='lowest'"),
    ({"name": "a/b"}, "name='a/b' is not allowed"),
    ({"name": "ab\n"}, "name='ab\\n' is not allowed"),  # `$` alone lets a newline end it
    ({"early_terminate": {}}, "unknown key 'early_terminate'"),
])
def test_a_bad_sweep_file_is_refused_naming_the_key(change, message):
    with pytest.raises(SweepError, match=".*") as err:
        sweep_of({**GRID, **change})
    assert message in str(err.value) and "\n" not in str(err.value)


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


@pytest.mark.parametrize("params, message", [
    ({"train.lrr": {"values": [1]}}, "parameters.train.lrr: unknown config key; known under "
                                     "train: max_steps"),
    ({"trian.lr": {"values": [1]}}, "parameters.trian.lr: not a config key"),
    ({"lr": {"values": [1]}}, "parameters.lr: not a config key"),
    ({"run.exp_name": {"values": ["x"]}}, "parameters.run.exp_name: the sweep sets it"),
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


def test_relaunching_records_the_same_trials_and_refuses_other_ones(tmp_path):
    sweep = sweep_of(GRID)
    rec = record.make(sweep, trials.choose(sweep))
    record.write(tmp_path, rec)
    record.write(tmp_path, rec)
    assert record.read(tmp_path) == rec
    other = record.make(sweep_of({**GRID, "run_cap": 2}), trials.choose(sweep)[:2])
    with pytest.raises(SweepError, match="with other trials"):
        record.write(tmp_path, other)


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


# ------------------------------------------------------------------------------ status


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


# ------------------------------------------------------------------------------ the CLI


def test_dry_run_prints_the_array_script_and_the_trial_table_and_writes_nothing(tmp_path):
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(GRID, sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--max-parallel", "3", "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}", cwd=tmp_path,
                     env=default_cluster(tmp_path))
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --array=0-5%3" in done.stdout
    assert "#   trial-5: train.lr=0.01, train.seed=2, model.n_layer=2" in done.stdout
    assert not (tmp_path / "st").exists()


def test_a_profile_s_spare_nodes_are_not_asked_for_by_every_trial(tmp_path):
    profile_file = tmp_path / "cluster.yaml"
    profile_file.write_text("nodes: 1\ngpus_per_node: 2\nspare_nodes: 1\n")
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(GRID, sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--cluster", str(profile_file), "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --nodes=1\n" in done.stdout and "#SBATCH --no-kill" not in done.stdout
    assert "SPARES=0" in done.stdout
    assert "spare_nodes=1 is not used by a sweep" in done.stderr


def test_the_profile_and_the_image_are_found_as_launch_finds_them(tmp_path):
    """Without --cluster and --image, `sweep launch` reads $PYRECOVER_CLUSTER and
    $PYRECOVER_IMAGE, as `launch` does; with neither a profile nor ~/.config's, one line."""
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump(GRID, sort_keys=False))
    (tmp_path / "cluster.yaml").write_text("partition: sweeps\nnodes: 1\ngpus_per_node: 2\n")
    (tmp_path / "my.sif").write_text("")
    argv = ["sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
            "--set", f"run.storage={tmp_path / 'st'}"]
    done = pyrecover(*argv, cwd=tmp_path, env={
        "HOME": str(tmp_path), "PYRECOVER_CLUSTER": str(tmp_path / "cluster.yaml"),
        "PYRECOVER_IMAGE": str(tmp_path / "my.sif")})
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --partition=sweeps" in done.stdout
    assert "#SBATCH --ntasks-per-node=2" in done.stdout
    assert f"apptainer exec --nv --bind {tmp_path / 'st'}:{tmp_path / 'st'} " \
           f"{tmp_path / 'my.sif'} " in done.stdout

    done = pyrecover(*argv, cwd=tmp_path, env={"HOME": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: no cluster profile: pass --cluster FILE, set "
                               "PYRECOVER_CLUSTER"), lines[0]
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("body, message", [
    ("method: grid\nparameters:\n  train.nope: {values: [1]}\n", "parameters.train.nope"),
    ("method: random\nparameters:\n  train.lr: {values: [1]}\n", "needs run_cap"),
    ("method: [grid\n", "not valid YAML"),
    ("method: grid\xff\n", "not UTF-8 text (byte 0xff"),
    ("method: grid\nparameters:\n  train.lr: &v {values: [1]}\n  train.seed: *v\n",
     "YAML aliases (*name) are not allowed"),
    ("method: random\nrun_cap: 2\nparameters:\n  train.lr: {min: 1, max: 1" + "0" * 400
     + "}\n", "parameters.train.lr: max=1000"),
    ("method: random\nrun_cap: 1000000000\nparameters:\n  train.lr: {min: 0.001, max: 0.01}\n",
     "1000000000 trials; a sweep has at most 10000"),
    ("method: grid\nparameters:\n" + "".join(f"  model.k{i}: {{values: {list(range(10))}}}\n"
                                            for i in range(9)),
     "1000000000 trials; a sweep has at most 10000"),
    ("method: grid\nseed: " + "x" * 5000 + "\nparameters:\n  train.lr: {values: [1]}\n",
     "seed='xxxx"),
])
def test_a_bad_sweep_is_one_line_exit_2_and_writes_nothing(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(body.encode("latin-1"))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY),
                     "--set", f"run.storage={tmp_path / 'st'}", cwd=tmp_path,
                     env=default_cluster(tmp_path))
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
    assert not (tmp_path / "st").exists()


def test_launch_writes_the_sweep_and_every_trial_then_refuses_a_second_live_array(tmp_path):
    """`sbatch` and `squeue` are stand-ins here (tests/slurm runs the real ones): sbatch
    answers job 77, squeue says what SQUEUE_SAYS holds."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 77\n")
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {tmp_path / 'squeue-says'}\n")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    (tmp_path / "squeue-says").write_text("")
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({**GRID, "name": "lr"}, sort_keys=False))
    args = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
            "--set", f"run.storage={tmp_path / 'st'}"]
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **default_cluster(tmp_path)}

    done = pyrecover(*args, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "submitted job array 77 (6 trials)" in done.stdout
    sweep_dir = tmp_path / "st" / "lr"
    assert record.read(sweep_dir).trials[5] == {
        "index": 5, "dir": "trial-5",
        "params": {"train.lr": 0.01, "train.seed": 2, "model.n_layer": 2}}
    assert (sweep_dir / "job.sbatch").read_text().count("#SBATCH --array=0-5") == 1
    trial = config_mod.load(sweep_dir / "trial-5" / "run.yaml")
    assert (trial.train.lr, trial.train.seed, trial.run.exp_name) == (0.01, 2, "trial-5")

    script = sweep_dir / "job.sbatch"  # squeue --me -o %i|%T|%o: the array's tasks
    for live in ("RUNNING", "REQUEUE_HOLD", "SUSPENDED"):
        (tmp_path / "squeue-says").write_text(f"5|RUNNING|/elsewhere/job.sbatch\n"
                                              f"77_0|{live}|{script}\n"
                                              f"77_[1-5]|PENDING|{script}\n")
        done = pyrecover(*args, env=env, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert f"job array 77 is still queued or running ({live})" in done.stderr
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 1\n")  # SLURM does not answer
    done = pyrecover(*args, env=env, cwd=tmp_path)
    assert done.returncode == 2 and "squeue did not answer" in done.stderr, done.stderr
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {tmp_path / 'squeue-says'}\n")

    (tmp_path / "squeue-says").write_text("")
    done = pyrecover(*args, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (sweep_dir / "jobs").read_text().split() == ["77", "77"]

    path.write_text(yaml.safe_dump({**GRID, "name": "lr", "run_cap": 2}, sort_keys=False))
    done = pyrecover(*args, env=env, cwd=tmp_path)
    assert done.returncode == 2 and "holds sweep 'lr' with other trials" in done.stderr

    # A run and a sweep of one name in one storage shared a folder (and `pyrecover cancel`
    # of the run found the sweep's array by its job script): refused both ways.
    run = pyrecover("launch", "--config", str(TINY), "--launcher", "none", "--exp-name", "lr",
                    "--set", f"run.storage={tmp_path / 'st'}", env=env, cwd=tmp_path)
    assert run.returncode == 2 and "holds a sweep" in run.stderr, run.stderr
    RunDir(tmp_path / "st" / "solo").create()
    RunDir(tmp_path / "st" / "solo").event("start", step=0)
    path.write_text(yaml.safe_dump({**GRID, "name": "solo"}, sort_keys=False))
    done = pyrecover(*args, env=env, cwd=tmp_path)
    assert done.returncode == 2 and "holds a run" in done.stderr, done.stderr
    # --dry-run shows what the launch would do: it refuses the same, in the same line.
    dry = pyrecover(*args, "--dry-run", env=env, cwd=tmp_path)
    assert dry.returncode == 2 and dry.stderr == done.stderr and not dry.stdout, dry.stderr
    path.write_text(yaml.safe_dump({**GRID, "name": "lr", "run_cap": 2}, sort_keys=False))
    dry = pyrecover(*args, "--dry-run", env=env, cwd=tmp_path)
    assert dry.returncode == 2 and "holds sweep 'lr' with other trials" in dry.stderr


def test_a_trial_of_a_sweep_with_an_auto_global_batch_trains(tmp_path, corpus):
    """The default global batch is `auto:N`: every trial's run.yaml used to keep the string,
    and the trial's first start, resolving it to a number, refused its own run directory as
    'started with another config' (exit 2, never requeued)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\necho 78\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 0\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({"name": "lr", "method": "grid", "parameters": {
        "train.lr": {"values": [1e-3, 2e-3]}}}, sort_keys=False))
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", **default_cluster(tmp_path)}  # 4 ranks
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}", "--set", f"data.path={corpus}",
                     "--set", "train.global_batch_size=auto:12", env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trial = tmp_path / "st" / "lr" / "trial-1"
    assert config_mod.load(trial / "run.yaml").train.global_batch_size == 8  # 4 x 2 splits it
    trained = pyrecover("train", "--config", str(trial / "run.yaml"), "--set",
                        "train.max_steps=2")
    assert trained.returncode == 0, trained.stderr[-2000:]
    assert [e["event"] for e in RunDir(trial).read_events()].count("finish") == 1


def test_sweep_status_of_a_missing_folder_says_it_does_not_exist(tmp_path):
    done = pyrecover("sweep", "status", str(tmp_path / "nowhere"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: sweep directory '{tmp_path / 'nowhere'}' does not exist"]
