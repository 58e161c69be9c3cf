"""`sweep launch` as a user runs it: the dry run, the profile and image found as `launch`
finds them, one line for a bad sweep, the records a launch writes and the second live array it
refuses, a relaunch that changes the trials, and an sbatch that refuses or does not answer.
The trials a launch leaves, and `sweep status`, are in test_sweep_trials.py."""

from __future__ import annotations

import pytest
import yaml
from helpers import TINY, default_cluster, pyrecover

from pyrecover import config as config_mod
from pyrecover.rundir import RunDir
from pyrecover.sweep import record

GRID = {"method": "grid", "parameters": {"train.lr": {"values": [1e-3, 3e-3, 1e-2]},
                                         "train.seed": {"values": [1, 2]},
                                         "model.n_layer": {"value": 2}}}


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


def test_a_trial_that_repeats_another_s_values_is_said_before_it_runs(tmp_path):
    """values: [0.001, 0.001] (or random draws of discrete values that meet) launched two
    identical trials without a word: the same seed trains the very same run twice."""
    path = tmp_path / "lr.yaml"
    path.write_text("method: grid\nparameters:\n  train.lr: {values: [1e-3, 0.002, 0.001]}\n")
    done = pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--dry-run",
                     "--launcher", "none", "--set", f"run.storage={tmp_path / 'st'}",
                     cwd=tmp_path, env=default_cluster(tmp_path))
    assert done.returncode == 0, done.stderr
    notes = [line for line in done.stderr.splitlines() if "has the values of" in line]
    assert notes == ["note: trial 2 has the values of trial 0 (train.lr=0.001): it trains the "
                     "same run again; drop the repeated value, or sweep train.seed too"]


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

    # An image named but missing here, and none at all: the dry run renders and says so,
    # as `launch --dry-run` does; the launch refuses both.
    cluster = {"HOME": str(tmp_path), "PYRECOVER_CLUSTER": str(tmp_path / "cluster.yaml")}
    for image, note in ((tmp_path / "gone.sif", f"note: image '{tmp_path / 'gone.sif'}' does "
                         "not exist here: a launch from this machine would refuse it"),
                        (None, f"note: no image is set: the script names "
                         f"{tmp_path / 'pyrecover.sif'}, which `make image` builds here")):
        env = {**cluster, **({"PYRECOVER_IMAGE": str(image)} if image else {})}
        dry = pyrecover(*argv, cwd=tmp_path, env=env)
        assert dry.returncode == 0 and note in dry.stderr, dry.stderr
        assert f" {image or tmp_path / 'pyrecover.sif'} " in dry.stdout
        real = pyrecover(*argv[:-3], *argv[-2:], cwd=tmp_path, env=env)  # no --dry-run
        assert real.returncode == 2 and "image" in real.stderr, real.stderr

    done = pyrecover(*argv, cwd=tmp_path, env={"HOME": str(tmp_path)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: no cluster profile: pass --cluster FILE, set "
                               "PYRECOVER_CLUSTER"), lines[0]
    assert not (tmp_path / "st").exists()


@pytest.mark.parametrize("body, message", [
    ("method: grid\nparameters:\n  train.nope: {values: [1]}\n",
     "bad.yaml: parameters.train.nope: unknown config key"),  # the file named, as below
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
    assert "submitted job array 77 (6 trials):\n  trial-0: train.lr=0.001" in done.stdout
    assert "#" not in done.stdout  # the dry run's table is script comments; this is not
    sweep_dir = tmp_path / "st" / "lr"
    assert record.read(sweep_dir).trials[5] == {
        "index": 5, "dir": "trial-5",
        "params": {"train.lr": 0.01, "train.seed": 2, "model.n_layer": 2}}
    assert (sweep_dir / "job.sbatch").read_text().count("#SBATCH --array=0-5") == 1
    trial = config_mod.load(sweep_dir / "trial-5" / "run.yaml")
    assert (trial.train.lr, trial.train.seed, trial.run.exp_name) == (0.01, 2, "trial-5")

    script = sweep_dir / "job.sbatch"  # squeue --me -o %i|%T|%o: the array's tasks
    for live in ("RUNNING", "REQUEUE_HOLD", "SUSPENDED"):  # every task's state is said
        (tmp_path / "squeue-says").write_text(f"5|RUNNING|/elsewhere/job.sbatch\n"
                                              f"77_[1-5]|PENDING|{script}\n"
                                              f"77_0|{live}|{script}\n")
        done = pyrecover(*args, env=env, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        states = ", ".join(sorted({live, "PENDING"}))
        assert f"job array 77 is still queued or running ({states})" in done.stderr
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 1\n")  # SLURM does not answer
    done = pyrecover(*args, env=env, cwd=tmp_path)  # a fault of the cluster, not a mistake
    assert done.returncode == 1 and "squeue did not answer" in done.stderr, done.stderr
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


def stub_slurm(tmp_path, job_id: int = 79) -> dict[str, str]:
    """stub_slurm: `sbatch` answers `job_id` and `squeue` lists nothing (tests/slurm runs
    the real ones); the environment that puts them first, with the default profile."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho {job_id}\n")
    (bin_dir / "squeue").write_text("#!/bin/sh\nexit 0\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin", **default_cluster(tmp_path)}


def test_a_relaunch_that_changes_what_the_trials_compute_names_the_way_out(tmp_path, corpus):
    """The trials' run.yaml refuse another model, as any run's does; the way out is a new
    sweep name (the trials' own names are the sweep's), not `--run-dir`, which sweep lacks."""
    env = stub_slurm(tmp_path)
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({**GRID, "name": "lr"}, sort_keys=False))
    args = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
            "--set", f"run.storage={tmp_path / 'st'}", "--set", f"data.path={corpus}"]
    assert pyrecover(*args, env=env, cwd=tmp_path).returncode == 0
    recorded = (tmp_path / "st" / "lr" / "trial-0" / "run.yaml").read_text()
    for extra in ((), ("--dry-run",)):
        done = pyrecover(*args, "--set", "model.n_embd=32", *extra, env=env, cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        (line,) = done.stderr.splitlines()
        assert "was started with another config (model.n_embd: 64 -> 32)" in line
        assert line.endswith("use a new sweep name (name: in the sweep file, or another file "
                             "name), or restore the old values"), line
    assert (tmp_path / "st" / "lr" / "trial-0" / "run.yaml").read_text() == recorded


def test_a_sweep_sbatch_refused_leaves_no_folder_so_its_name_stays_free(tmp_path, corpus):
    """sbatch refused the array (a wrong partition): the new sweep's folder, sweep.yaml and
    trials, stayed behind, and the fixed sweep file was then refused, "holds sweep 'lr' with
    other trials; give this sweep another name", for a sweep that never ran. A folder that
    was there before (a relaunch) is kept."""
    env = stub_slurm(tmp_path)
    sbatch = tmp_path / "bin" / "sbatch"
    sbatch.write_text("#!/bin/sh\necho 'sbatch: error: invalid partition specified' >&2\n"
                      "exit 1\n")
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({**GRID, "name": "lr"}, sort_keys=False))
    argv = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
            "--set", f"run.storage={tmp_path / 'st'}", "--set", f"data.path={corpus}"]
    done = pyrecover(*argv, env=env, cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith("error: sbatch refused the job: "), done.stderr
    assert not (tmp_path / "st").exists()  # nor the storage folder the launch made for it

    sbatch.write_text("#!/bin/sh\necho 79\n")
    fixed = {**GRID, "name": "lr", "parameters": {"train.lr": {"values": [1e-3]}}}
    path.write_text(yaml.safe_dump(fixed, sort_keys=False))
    assert pyrecover(*argv, env=env, cwd=tmp_path).returncode == 0
    sbatch.write_text("#!/bin/sh\nexit 1\n")
    assert pyrecover(*argv, env=env, cwd=tmp_path).returncode == 2
    assert (tmp_path / "st" / "lr" / "trial-0" / "run.yaml").is_file()
    assert (tmp_path / "st" / "lr" / "jobs").read_text() == "79\n"


def test_a_sweep_s_sbatch_answers_within_pyrecover_sbatch_timeout_as_launch_s_does(
        tmp_path, corpus):
    """sweep launch waited up to 120 s for sbatch whatever PYRECOVER_SBATCH_TIMEOUT said, and
    said nothing while it waited; a bad value is refused before anything is written."""
    env = stub_slurm(tmp_path)
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/sh\nsleep 30\n")
    path = tmp_path / "lr.yaml"
    path.write_text(yaml.safe_dump({**GRID, "name": "lr"}, sort_keys=False))
    argv = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
            "--set", f"run.storage={tmp_path / 'st'}", "--set", f"data.path={corpus}"]
    bad = pyrecover(*argv, env={**env, "PYRECOVER_SBATCH_TIMEOUT": "soon"}, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.splitlines()[-1] == (
        "error: PYRECOVER_SBATCH_TIMEOUT='soon': expected seconds, e.g. 300"), bad.stderr
    assert not (tmp_path / "st" / "lr").exists()
    slow = pyrecover(*argv, env={**env, "PYRECOVER_SBATCH_TIMEOUT": "5"}, cwd=tmp_path)
    assert slow.returncode == 1, slow.stderr  # SLURM's fault, not the user's mistake (2)
    assert "pyrecover: waiting for SLURM (sbatch) to answer" in slow.stderr
    assert slow.stderr.splitlines()[-1].startswith("error: sbatch did not answer within 5s")
    assert (tmp_path / "st" / "lr").is_dir()  # the array may be queued: its folder stays
