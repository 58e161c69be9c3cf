"""The trials `sweep launch` leaves, as a user meets them: each one trains (an auto global
batch, a swept data path relative or under ~), `sweep status` of the whole array, and
`status`, `sweep status` and `train` pointed at a sweep or a trial. `sweep launch` itself is
test_sweep_launch.py."""

from __future__ import annotations

import json

import yaml
from helpers import TINY, default_cluster, pyrecover
from test_sweep_launch import GRID, stub_slurm

from pyrecover import config as config_mod
from pyrecover.rundir import RunDir


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


def test_a_swept_relative_data_path_is_made_absolute_so_the_trial_finds_it(tmp_path, corpus):
    """A trial starts in its sweep's folder (`#SBATCH --chdir`): a swept `data.path` of
    `data/a.parquet` stayed relative in run.yaml and every trial failed at its start."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.parquet").write_bytes(corpus.read_bytes())
    path = tmp_path / "paths.yaml"
    path.write_text(yaml.safe_dump({"name": "paths", "method": "grid", "parameters": {
        "data.path": {"values": ["data/a.parquet", str(corpus)]}}}, sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}",
                     "--set", "train.global_batch_size=8", env=stub_slurm(tmp_path),
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    sweep_dir = tmp_path / "st" / "paths"
    trial = sweep_dir / "trial-0"
    assert config_mod.load(trial / "run.yaml").data.path == str(tmp_path / "data" / "a.parquet")
    assert config_mod.load(sweep_dir / "trial-1" / "run.yaml").data.path == str(corpus)
    trained = pyrecover("train", "--config", str(trial / "run.yaml"), "--set",
                        "train.max_steps=1", cwd=sweep_dir)
    assert trained.returncode == 0, trained.stderr[-2000:]


def test_a_swept_data_path_under_the_home_folder_written_with_a_tilde_is_read_there(tmp_path,
                                                                                    corpus):
    """`~/a.parquet` was taken as relative: the trial looked for `<cwd>/~/a.parquet`."""
    path = tmp_path / "home.yaml"
    path.write_text(yaml.safe_dump({"name": "home", "method": "grid", "parameters": {
        "data.path": {"values": ["~/a.parquet"]}}}, sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}",
                     "--set", "train.global_batch_size=8",
                     env={**stub_slurm(tmp_path), "HOME": str(tmp_path / "home")}, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trial = tmp_path / "st" / "home" / "trial-0"
    assert config_mod.load(trial / "run.yaml").data.path == str(tmp_path / "home" / "a.parquet")


def test_a_bayes_sweep_refuses_a_relative_data_path_wandb_would_hand_on_as_written(tmp_path):
    path = tmp_path / "paths.yaml"
    path.write_text(yaml.safe_dump({"name": "paths", "method": "bayes", "run_cap": 2,
                                    "metric": {"name": "loss", "goal": "minimize"},
                                    "parameters": {"data.path": {"values": ["data/a.parquet"]},
                                                   "train.lr": {"min": 1e-4, "max": 1e-3}}},
                                   sort_keys=False))
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--launcher", "none", "--set", f"run.storage={tmp_path / 'st'}",
                     cwd=tmp_path, env=default_cluster(tmp_path))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: parameters.data.path: 'data/a.parquet' is a relative path, and a bayes trial "
        "gets it from wandb as written, in its sweep's folder; give absolute paths"]


def test_sweep_status_asks_slurm_twice_for_the_whole_array_and_names_each_task_s_state(
        tmp_path, corpus):
    """A 12-trial sweep: one scontrol (the tasks it still holds, finished ones too) and one
    squeue -r (queued and running, one line per task), not two calls per trial."""
    env = stub_slurm(tmp_path, job_id=79)
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({"name": "lr", "method": "grid", "parameters": {
        "train.lr": {"values": [1e-4 * (i + 1) for i in range(12)]}}}, sort_keys=False))
    launched = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher",
                         "none", "--set", f"run.storage={tmp_path / 'st'}", "--set",
                         f"data.path={corpus}", env=env, cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    calls = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    (tmp_path / "scontrol.out").write_text("\n".join(
        [f"JobId={100 + i} ArrayJobId=79 ArrayTaskId={i} JobState=COMPLETED" for i in range(4)]
        + ["JobId=79 ArrayJobId=79 ArrayTaskId=6-11%2 JobState=PENDING",
           "JobId=104 ArrayJobId=79 ArrayTaskId=4 JobState=RUNNING"]) + "\n")
    (tmp_path / "squeue.out").write_text("\n".join(
        ["79_4 RUNNING", "79_5 RUNNING"] + [f"79_{i} PENDING" for i in range(6, 12)]) + "\n")
    for name in ("scontrol", "squeue"):
        (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {calls}\n'
                                    f'cat {tmp_path / (name + ".out")}\n')
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    done = pyrecover("sweep", "status", str(tmp_path / "st" / "lr"), "--json", env=env)
    assert done.returncode == 0, done.stderr
    assert calls.read_text().splitlines() == ["scontrol show job -o 79",
                                              "squeue -h -r -j 79 -o %i %T"]
    states = {t["run_dir"].rsplit("-", 1)[1]: t["slurm_state"]
              for t in json.loads(done.stdout)["trials"]}
    assert states == {**{str(i): "COMPLETED" for i in range(4)}, "4": "RUNNING",
                      "5": "RUNNING", **{str(i): "PENDING" for i in range(6, 12)}}


def test_train_with_a_sweep_s_name_is_told_it_names_a_sweep(tmp_path, corpus):
    """It was told the folder 'holds other runs (trial-0, ...)' and to train in
    <sweep>/NAME: a run among the trials, which the sweep's status and cancel would miss."""
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({**GRID, "name": "lr"}, sort_keys=False))
    args = ["--set", f"run.storage={tmp_path / 'st'}", "--set", f"data.path={corpus}"]
    launched = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher",
                         "none", *args, env=stub_slurm(tmp_path), cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    done = pyrecover("train", "--config", str(TINY), *args, "--set", "run.exp_name=lr")
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"error: {tmp_path / 'st' / 'lr'} holds a sweep "
                                        "(lr/sweep.yaml), not a run; use another run.exp_name"]


def test_status_of_a_sweep_and_sweep_status_of_a_trial_point_at_each_other(tmp_path, corpus):
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({**GRID, "name": "lr"}, sort_keys=False))
    launched = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher",
                         "none", "--set", f"run.storage={tmp_path / 'st'}", "--set",
                         f"data.path={corpus}", env=stub_slurm(tmp_path), cwd=tmp_path)
    assert launched.returncode == 0, launched.stderr
    sweep, trial = tmp_path / "st" / "lr", tmp_path / "st" / "lr" / "trial-0"
    run_status = pyrecover("status", str(sweep))
    assert run_status.returncode == 2
    assert run_status.stderr.splitlines() == [
        f"error: {sweep} holds a sweep, not a run: `pyrecover sweep status {sweep}` shows its "
        f"trials, each a run ({sweep}/trial-0, ...)"]
    of_trial = pyrecover("sweep", "status", str(trial))
    assert of_trial.returncode == 2
    assert of_trial.stderr.splitlines() == [
        f"error: {trial} is a trial of sweep {sweep}, a run: `pyrecover status {trial}` shows "
        f"it, `pyrecover sweep status {sweep}` the sweep"]
