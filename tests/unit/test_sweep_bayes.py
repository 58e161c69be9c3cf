"""Bayes sweeps: the grammar and the launch's refusals, the values wandb hands out checked and
recorded once in the trial's folder, and every later start reading them back without asking.
wandb's agent protocol itself, through wandb's own client, is test_sweep_bayes_wandb.py; the
SLURM run of a bayes sweep, requeue included, is tests/slurm/test_sweep_bayes_e2e.py."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import yaml
from helpers import REPO, TINY, default_cluster, pyrecover
from sbatch_support import HOSTILE, run_step, shellcheck
from test_sweep import base_config

from pyrecover import config as config_mod
from pyrecover.rundir import RunDir
from pyrecover.slurm import profile
from pyrecover.slurm.render import render
from pyrecover.sweep import SweepError, agent, bayes, record, spec, trials, wandb_sweep
from pyrecover.sweep import render as sweep_render
from pyrecover.sweep import status as sweep_status

BAYES = {"name": "bo", "method": "bayes", "metric": {"name": "loss", "goal": "minimize"},
         "run_cap": 3, "parameters": {
             "train.lr": {"distribution": "log_uniform_values", "min": 1e-4, "max": 1e-2},
             "train.warmup_steps": {"min": 0, "max": 4},
             "model.n_embd": {"values": [32, 64]}}}
KEY = "k" * 40


def launched(tmp_path: Path, raw: dict | None = None) -> tuple[spec.Sweep, Path]:
    """A bayes sweep's folder as `sweep launch` leaves it (registered as sweep `sw1`)."""
    sweep = trials.absolute_values(spec.parse(raw or BAYES, "bo"), str(tmp_path))  # as launch
    cfg = trials.base_for(sweep, base_config(str(tmp_path / "st")))
    cfg.tracking.sweep_id = "sw1"
    rec = record.make(sweep, [None] * (sweep.run_cap or 0))
    rec = record.Record(**{**rec.__dict__, "wandb": {"sweep_id": "sw1", "url": None}})
    sweep_dir = cfg.run_dir()
    record.write(sweep_dir, rec)
    bayes.keep_base(sweep_dir, cfg)
    return sweep, sweep_dir


class Wandb:
    """What wandb's controller would hand out, and how often it was asked."""

    def __init__(self, *runs: agent.Run) -> None:
        self.runs, self.asked = list(runs), []

    def __call__(self, sweep_id: str, cfg: config_mod.Config) -> agent.Run:
        self.asked.append((sweep_id, cfg.run.exp_name))
        return self.runs.pop(0)


def args(**values) -> dict:
    return {k.replace("__", "."): {"value": v} for k, v in values.items()}


GOOD = args(train__lr=0.002, train__warmup_steps=3, model__n_embd=64)


# ------------------------------------------------------------------------ grammar, launch

def test_a_bayes_sweep_keeps_its_parameters_in_the_record_as_the_file_gives_them(tmp_path):
    sweep, sweep_dir = launched(tmp_path)
    rec = record.read(sweep_dir)
    assert rec.method == "bayes" and [t["params"] for t in rec.trials] == [None] * 3
    assert bayes.sweep_of(rec).params == sweep.params
    assert rec.parameters["train.warmup_steps"] == {
        "distribution": "int_uniform", "min": 0, "max": 4}


def test_wandb_gets_a_bayes_sweep_without_the_local_controller(tmp_path):
    path = tmp_path / "bo.yaml"
    path.write_text(yaml.safe_dump({**BAYES, "max_parallel": 2}))
    assert wandb_sweep.sweep_config(path, "bo") == BAYES


def test_wandb_gets_numbers_where_yaml_1_1_reads_1e_3_as_a_string(tmp_path):
    path = tmp_path / "bo.yaml"
    path.write_text("method: bayes\nmetric: {name: loss}\nrun_cap: 2\nparameters:\n"
                    "  train.lr: {distribution: log_uniform_values, min: 1e-4, max: 1e-2}\n"
                    "  train.seed: {values: [1, 2]}\n")
    sent = wandb_sweep.sweep_config(path, "bo")["parameters"]
    assert sent == {"train.lr": {"distribution": "log_uniform_values", "min": 1e-4,
                                 "max": 1e-2}, "train.seed": {"values": [1, 2]}}


def test_the_example_bayes_sweep_passes_the_launchs_checks_on_the_tiny_experiment():
    sweep = spec.load(REPO / "launch" / "sweeps" / "tiny-bayes.yaml")
    assert (sweep.method, sweep.run_cap, sweep.metric) == ("bayes", 8, "loss")
    bayes.check_launch(sweep, trials.base_for(sweep, config_mod.load(TINY)), 1)


def test_a_relaunch_with_an_experiment_that_computes_otherwise_is_refused(tmp_path):
    sweep, sweep_dir = launched(tmp_path)
    base = bayes.load_base(sweep_dir)
    bayes.keep_base(sweep_dir, base)  # the same: accepted
    base.model.n_layer += 1
    with pytest.raises(SweepError, match=r"launched with another experiment \(model.n_layer"):
        bayes.keep_base(sweep_dir, base)


@pytest.mark.parametrize("change, message", [
    ({"train.lr": {"min": 0.0, "max": 1e-3}},
     "parameters.train.lr=0.0 (a value wandb may choose): "),
    ({"model.n_embd": {"values": [32, 63]}}, "parameters.model.n_embd=63 (a value wandb may"),
    ({"train.nope": {"min": 0, "max": 1}}, "parameters.train.nope: unknown config key"),
    ({"run.storage": {"value": "/x"}}, "parameters.run.storage: the sweep sets it"),
])
def test_the_launch_checks_every_value_wandb_may_choose_against_the_config(change, message):
    raw = {**BAYES, "parameters": {**BAYES["parameters"], **change}}
    sweep = spec.parse(raw, "bo")
    with pytest.raises(SweepError) as err:
        bayes.check_launch(sweep, trials.base_for(sweep, base_config()), 1)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_bayes_sweep_ranked_by_mfu_on_the_cpu_is_refused_at_launch():
    sweep = spec.parse({**BAYES, "metric": {"name": "mfu", "goal": "maximize"}}, "bo")
    cpu = config_mod.load(TINY, ["run.storage=/s", "train.device=cpu"])
    with pytest.raises(SweepError) as err:
        bayes.check_launch(sweep, trials.base_for(sweep, cpu), 1)
    assert str(err.value).startswith("metric.name='mfu': a trial with train.lr=0.0001 trains "
                                     "on the CPU (train.device=cpu)"), err.value
    bayes.check_launch(sweep, trials.base_for(sweep, base_config()), 1)  # auto: a GPU


@pytest.mark.parametrize("sets, env, why", [
    (["tracking.wandb=offline"], {"WANDB_API_KEY": KEY}, "tracking.wandb=offline resolves to "
                                                         "offline"),
    (["tracking.wandb=online"], {}, "no API key"),
    ([], {"WANDB_MODE": "offline", "WANDB_API_KEY": KEY}, "tracking.wandb=auto resolves to "
                                                          "offline"),
])
def test_bayes_offline_or_without_a_key_is_refused_in_one_line(tmp_path, sets, env, why):
    path = tmp_path / "bo.yaml"
    path.write_text(yaml.safe_dump(BAYES))
    argv = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
            "--set", f"run.storage={tmp_path / 'st'}", "--set", "tracking.wandb=auto"]
    for item in sets:
        argv += ["--set", item]
    for dry in ([], ["--dry-run"]):
        done = pyrecover(*argv, *dry, cwd=tmp_path,
                         env={"HOME": str(tmp_path), "WANDB_MODE": "",
                              **default_cluster(tmp_path), **env})
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, done.stderr
        assert lines[0].startswith(f"error: method=bayes needs tracking.wandb online with an "
                                   f"API key ({why})"), lines[0]
        assert not (tmp_path / "st").exists()


# ------------------------------------------------------------------ values: once, recorded

def test_a_trials_first_start_records_what_wandb_handed_out_and_later_starts_reuse_it(
        tmp_path):
    _, sweep_dir = launched(tmp_path)
    trial = sweep_dir / "trial-1"
    wandb = Wandb(agent.Run("run1abc", GOOD))
    got = bayes.take(trial, wandb, world_size=1)
    assert (got.values, got.run_id, got.asked) == (
        {"train.lr": 0.002, "train.warmup_steps": 3, "model.n_embd": 64}, "run1abc", True)
    assert wandb.asked == [("sw1", "bo")]
    cfg = config_mod.load(trial / "run.yaml")
    assert (cfg.train.lr, cfg.train.warmup_steps, cfg.model.n_embd) == (0.002, 3, 64)
    assert (cfg.run.exp_name, cfg.tracking.sweep_id, cfg.tracking.name) == (
        "trial-1", "sw1", "bo-trial-1")
    assert (trial / "wandb" / "run-id").read_text() == "run1abc\n"
    params = yaml.safe_load((trial / "wandb" / "sweep-params.yaml").read_text())
    assert params == {"wandb_version": 1, **GOOD}  # wandb's config-file format
    assert sorted(p.name for p in trial.rglob(".*")) == []  # no temporary file left

    again = bayes.take(trial, Wandb(), world_size=1)  # asking would pop from an empty list
    assert (again.values, again.run_id, again.asked) == (got.values, "run1abc", False)


def test_a_trial_whose_wandb_folder_was_removed_keeps_its_values_and_trains(tmp_path):
    """`rm -r trial-*/wandb` after `wandb sync`: every later start's `sweep values` ended
    'wandb/run-id: No such file or directory', exit 1, so the trial requeued as a crash
    until its restarts ran out and never trained again, its values in run.yaml all along."""
    _, sweep_dir = launched(tmp_path)
    trial = sweep_dir / "trial-1"
    got = bayes.take(trial, Wandb(agent.Run("run1abc", GOOD)), world_size=1)
    shutil.rmtree(trial / "wandb")
    again = bayes.take(trial, Wandb(), world_size=1)  # asking would pop from an empty list
    assert (again.values, again.run_id, again.asked) == (got.values, None, False)


def test_a_relaunch_s_new_limits_reach_the_base_and_every_trial_that_started(tmp_path):
    """A relaunch with --set train.max_steps=N exited 0 and changed nothing: base.yaml was
    kept as it was and a started trial's run.yaml never rewritten."""
    _, sweep_dir = launched(tmp_path)
    bayes.take(sweep_dir / "trial-1", Wandb(agent.Run("run1abc", GOOD)), world_size=1)
    base = bayes.load_base(sweep_dir)
    longer = dataclasses.replace(base, train=dataclasses.replace(
        base.train, max_steps=base.train.max_steps + 500))
    bayes.keep_base(sweep_dir, longer)
    bayes.refresh(sweep_dir, longer, world_size=1)
    assert bayes.load_base(sweep_dir).train.max_steps == longer.train.max_steps
    trial = config_mod.load(sweep_dir / "trial-1" / "run.yaml")
    assert (trial.train.max_steps, trial.train.lr) == (longer.train.max_steps, 0.002)
    assert not (sweep_dir / "trial-0" / "run.yaml").exists()  # no values yet: nothing to write


def test_a_copied_bayes_sweep_s_trial_trains_in_the_copy_not_in_the_original(tmp_path):
    _, sweep_dir = launched(tmp_path / "a")
    copy = tmp_path / "b" / "bo"
    shutil.copytree(sweep_dir, copy)
    bayes.take(copy / "trial-0", Wandb(agent.Run("run0abc", GOOD)), world_size=1)
    cfg = config_mod.load(copy / "trial-0" / "run.yaml")
    assert cfg.run_dir() == (copy / "trial-0").resolve()
    assert not (sweep_dir / "trial-0" / "run.yaml").exists()


@pytest.mark.parametrize("handed, message", [
    (args(train__lr=0.002, train__warmup_steps=3), "the sweep has parameters"),
    ({**GOOD, "train.seed": {"value": 1}}, "the sweep has parameters"),
    (args(train__lr=0.5, train__warmup_steps=3, model__n_embd=64),
     "wandb handed out train.lr=0.5, outside parameters.train.lr (log_uniform_values "
     "min 0.0001, max 0.01)"),
    (args(train__lr=0.002, train__warmup_steps=2.5, model__n_embd=64), "train.warmup_steps=2.5"),
    (args(train__lr=0.002, train__warmup_steps=3, model__n_embd=48), "model.n_embd=48"),
    (args(train__lr=0.002, train__warmup_steps=3, model__n_embd="64"), "model.n_embd='64'"),
    ({"train.lr": 0.002}, "not {key: {value: ...}}"),
])
def test_a_value_the_sweep_does_not_allow_is_one_line_and_nothing_is_recorded(
        tmp_path, handed, message):
    _, sweep_dir = launched(tmp_path)
    trial = sweep_dir / "trial-0"
    with pytest.raises(SweepError) as err:
        bayes.take(trial, Wandb(agent.Run("r0", handed)), world_size=1)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not trial.exists() or not any(trial.rglob("*"))


def test_a_data_path_with_a_tilde_is_taken_as_wandb_hands_it_back(tmp_path, monkeypatch):
    """`data.path: {values: [~/a.parquet]}` was checked at launch as /home/me/a.parquet, but
    wandb is sent the file as written and hands back ~/a.parquet: every trial's first start
    was refused with "outside parameters.data.path", exit 2, after a launch that passed."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    raw = {**BAYES, "parameters": {**BAYES["parameters"],
                                   "data.path": {"values": ["~/a.parquet", "/b.parquet"]}}}
    _, sweep_dir = launched(tmp_path, raw)
    handed = {**GOOD, "data.path": {"value": "~/a.parquet"}}
    got = bayes.take(sweep_dir / "trial-0", Wandb(agent.Run("r0", handed)), world_size=1)
    assert got.values["data.path"] == "~/a.parquet"  # as the controller knows it
    cfg = config_mod.load(sweep_dir / "trial-0" / "run.yaml")
    assert cfg.data.path == str(tmp_path / "home" / "a.parquet")


def test_a_value_the_config_refuses_is_one_line_naming_the_trial(tmp_path):
    raw = {**BAYES, "parameters": {**BAYES["parameters"],
                                   "model.n_head": {"values": [2, 3]}}}
    _, sweep_dir = launched(tmp_path, raw)
    handed = {**GOOD, "model.n_head": {"value": 3}}  # 64 does not split into 3 heads
    with pytest.raises(SweepError) as err:
        bayes.take(sweep_dir / "trial-2", Wandb(agent.Run("r2", handed)), world_size=1)
    assert str(err.value).startswith("the values wandb handed to trial 2: ")
    assert "n_head" in str(err.value) and not (sweep_dir / "trial-2" / "run.yaml").exists()


@pytest.mark.parametrize("command, message", [
    ({"type": "exit"}, "hands out no more runs"),
    ({"type": "run", "run_id": "r"}, "a run without run_id and args"),
])
def test_a_sweep_that_hands_out_no_run_is_one_line(command, message):
    with pytest.raises(SweepError, match=message):
        agent._command(command, "sw1")
    assert agent._command({"type": "stop", "run_ids": ["x"]}, "sw1") is None


def test_a_run_id_that_is_no_run_id_is_refused(tmp_path):
    _, sweep_dir = launched(tmp_path)
    with pytest.raises(SweepError, match="which is no run id"):
        bayes.take(sweep_dir / "trial-0", Wandb(agent.Run("../x", GOOD)), world_size=1)


def test_status_shows_a_trial_without_values_as_such(tmp_path):
    _, sweep_dir = launched(tmp_path)
    bayes.take(sweep_dir / "trial-0", Wandb(agent.Run("r0", GOOD)), world_size=1)
    report = sweep_status.read(sweep_dir)
    by_index = {t.index: t for t in report.trials}
    assert by_index[0].params == {"train.lr": 0.002, "train.warmup_steps": 3,
                                  "model.n_embd": 64}
    assert [(by_index[i].params, by_index[i].state) for i in (1, 2)] == [
        ({}, sweep_status.NO_VALUES)] * 2
    text = sweep_status.render(report)
    assert "values: from wandb's bayes controller at each trial's first start" in text


def test_a_trial_that_ended_before_it_got_values_says_so_not_that_it_waits(tmp_path):
    """A trial whose values wandb handed out were refused (exit 2: the job script records
    no_requeue) read 'no values yet', which the legend calls 'not started yet': its user
    waited for a trial that had ended for good."""
    _, sweep_dir = launched(tmp_path)
    RunDir(sweep_dir / "trial-1").create()
    RunDir(sweep_dir / "trial-1").event("no_requeue", job_id="7_1", restart_count=0,
                                        exit_code=2, reason="config, data or training error")
    by_index = {t.index: t for t in sweep_status.read(sweep_dir).trials}
    assert by_index[1].state == "ended: config, data or training error, no values yet"
    assert by_index[2].state == sweep_status.NO_VALUES


def test_a_trial_whose_recorded_config_is_damaged_is_one_row_not_the_end_of_the_table(
        tmp_path):
    """A bayes trial's values are read back from its run.yaml: one damaged file (a full disk
    mid-write, a hand edit) ended `sweep status` with exit 2, so no trial was shown."""
    _, sweep_dir = launched(tmp_path)
    for i in (0, 1):
        bayes.take(sweep_dir / f"trial-{i}", Wandb(agent.Run(f"r{i}", GOOD)), world_size=1)
    (sweep_dir / "trial-1" / "run.yaml").write_text("model: [\n")
    report = sweep_status.read(sweep_dir)
    by_index = {t.index: t for t in report.trials}
    assert by_index[0].params == {"train.lr": 0.002, "train.warmup_steps": 3,
                                  "model.n_embd": 64}
    assert by_index[1].params == {}
    assert by_index[1].state.startswith("unreadable: ") and "run.yaml" in by_index[1].state
    assert "\n" not in by_index[1].state and by_index[2].state == sweep_status.NO_VALUES
    assert "unreadable: " in sweep_status.render(report)


# --------------------------------------------------------------------- the job script

@pytest.mark.parametrize("code, trains, requeued", [(0, True, False), (2, False, False),
                                                    (1, False, True)])
def test_each_task_gets_its_values_before_its_first_step_and_a_refusal_never_requeues(
        tmp_path, code, trains, requeued):
    """The `python` the script runs `sweep values` with is a stand-in exiting `code`; srun
    and scontrol are run_step's stand-ins."""
    storage = tmp_path / f"storage {HOSTILE}"
    python = tmp_path / "python"
    python.write_text(f"#!/bin/bash\nprintf '%s\\0' \"$@\" > {tmp_path}/values.argv\n"
                      f"exit {code}\n")
    python.chmod(0o755)
    sweep = spec.parse(BAYES, "bo")
    prof = profile.ClusterProfile(nodes=2, gpus_per_node=2, launcher="none")
    profile.validate(prof)
    base = trials.base_for(sweep, base_config(str(storage)))
    script = render(sweep_render.array_spec(base, prof, str(python), 3, None, bayes=True))
    trial = storage / "bo" / "trial-2"
    trial.mkdir(parents=True)
    argv, stderr, exit_code = run_step(script, tmp_path, env={
        "SLURM_ARRAY_JOB_ID": "120", "SLURM_ARRAY_TASK_ID": "2"})
    values = (tmp_path / "values.argv").read_text().split("\0")[:-1]
    assert values == ["-m", "pyrecover", "sweep", "values", "--world-size", "4", f"{trial}/"]
    assert (bool(argv), exit_code) == (trains, 0 if trains else code), stderr
    assert (tmp_path / "scontrol.requeue").exists() == requeued
    if not trains:
        (event,) = RunDir(trial).read_events()
        assert event["event"] == ("requeue" if requeued else "no_requeue")
    assert not list(tmp_path.rglob("pwned"))
    shellcheck(script, tmp_path, "SC2016")


def test_a_q_uniform_value_rounded_past_max_by_less_than_half_q_is_allowed():
    sweep = spec.parse({**BAYES, "parameters": {"train.grad_clip": {
        "distribution": "q_uniform", "min": 0.5, "max": 2.2, "q": 0.25}}}, "bo")
    assert bayes.check_values(sweep, args(train__grad_clip=2.25)) == {"train.grad_clip": 2.25}
    with pytest.raises(SweepError, match="train.grad_clip=2.5, outside"):
        bayes.check_values(sweep, args(train__grad_clip=2.5))


def test_the_launch_checks_the_values_q_uniform_rounds_its_ends_to():
    """wandb's q_uniform picks round(uniform(min, max) / q) * q: with min 0.002 and q 0.005
    it can hand out lr=0.0, which the launch, checking min itself, let through to fail each
    such trial at its first start."""
    sweep = spec.parse({**BAYES, "parameters": {"train.lr": {
        "distribution": "q_uniform", "min": 0.002, "max": 0.01, "q": 0.005}}}, "bo")
    assert bayes.edges(sweep.params[0]) == [0.0, 0.01]
    with pytest.raises(SweepError, match=r"parameters.train.lr=0.0 \(a value wandb may "):
        bayes.check_launch(sweep, trials.base_for(sweep, base_config()), 1)
    ints = spec.parse({**BAYES, "parameters": {"train.warmup_steps": {
        "distribution": "q_uniform", "min": 1, "max": 9, "q": 4}}}, "bo")
    assert bayes.edges(ints.params[0]) == [0, 8]
