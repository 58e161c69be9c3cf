"""`pyrecover launch`: bad input (a hostile profile file included) is one line with exit 2
before anything is written or submitted; paths become absolute; secrets stay out of the
script. (The profile's own checks: test_profile_input.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY, default_cluster, files_under, pyrecover
from sbatch_support import (
    HOSTILE,
    LOCAL,
    TINY_SETS,
    bash_words,
    expected_argv,
    run_step,
    sbatch_lines,
    shellcheck,
    spec_for,
)

from pyrecover import config as config_mod
from pyrecover.slurm import LaunchError, render


def launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """`pyrecover launch` the tiny run; the cluster profile is the built-in defaults (an
    empty file beside tmp_path) unless the test passes --cluster."""
    base = ["launch", "--config", str(TINY), "--set", f"run.storage={tmp_path / 'store'}",
            "--set", f"data.path={tmp_path / 'data.parquet'}"]
    env = {**default_cluster(tmp_path), **(env or {})}
    return pyrecover(*base, *args, env=env, cwd=tmp_path)


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "nodes=0 is not allowed: expected an integer >= 1"),
    (["--gpus-per-node", "3"], "train.global_batch_size=8 is not allowed"),
    (["--time", "1:2:3:4"], "time='1:2:3:4' is not allowed"),
    (["--time", "2"], "time='2' is not allowed: expected a limit longer than signal_seconds"),
    (["--launcher", "mpirun"], "launcher='mpirun' is not allowed: expected one of srun"),
    (["--image", "missing.sif", "--launcher", "srun"], "image "),
    # An unset variable (`--image "$SIF"`) was taken as the folder launch ran in.
    (["--image", ""], "image='' is not allowed: expected the path of an apptainer image"),
    (["--cluster", "nowhere.yaml"], "cluster profile 'nowhere.yaml' does not exist"),
    (["--cluster", "bad.yaml"], "unknown cluster profile key 'gpus'; known keys: account"),
    (["--exp-name", "a b"], "run.exp_name='a b'"),
    (["--exp-name", "x;$(reboot)"], "run.exp_name="),
    (["--mode", "nonsense"], "checkpoint.mode='nonsense'"),
    (["--bind", "a:relative"], "must be an absolute path inside the container"),
    (["--launcher", "none"], "sbatch not found on PATH"),
    (["--qos", "high prio"], "qos='high prio' is not allowed: expected letters, digits"),
    (["--constraint", "a100 && ib"], "constraint='a100 && ib' is not allowed"),
    (["--constraint", "a100;reboot"], "(cluster profile key constraint, option --constraint)"),
    (["--mem", "64GB"], "mem='64GB' is not allowed: expected memory per node"),
    (["--mem", "-1"], "mem='-1' is not allowed"),
    (["--sbatch-extra", "--time=2:00:00"], "sbatch_extra '--time=2:00:00' is not allowed: "
     "pyrecover sets --time itself (cluster profile key time, option --time)"),
    (["--sbatch-extra", "--reservation=big\n#SBATCH --time=5"],
     "sbatch_extra '--reservation=big\\n#SBATCH --time=5' is not allowed: an #SBATCH line "
     "cannot carry '\\n'"),
    (["--sbatch-extra", "--comment=a\rb"], "an #SBATCH line cannot carry '\\r'"),
    (["--sbatch-extra", "reservation=big"], "expected --name or --name=value"),
    (["--sbatch-extra", "--Reservation=big"], "expected --name or --name=value"),
    (["--sbatch-extra", "--res ervation"], "expected --name or --name=value"),
])
def test_bad_launch_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    (tmp_path / "bad.yaml").write_text("partition: debug\ngpus: 4\n")
    before = files_under(tmp_path)
    env = {"PATH": str(Path(sys.executable).parent)}  # no sbatch: nothing can be submitted
    done = launch(tmp_path, "--gpus-per-node", "2", *args, env=env)
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("note: ")]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert files_under(tmp_path) == before and done.stdout == ""


@pytest.mark.parametrize("body, message", [
    (b"\xbfpartition: debug\n", "p.yaml: not UTF-8 text (byte 0xbf at offset 0)"),
    (b"nodes: 1\nnodes: 2\n", "p.yaml line 2: key 'nodes' appears twice in one mapping"),
    (b"- &a [x, x]\n- [*a, *a]\n", "p.yaml line 2: YAML aliases (*name) are not allowed"),
    (b"[" + b"x, " * 1000 + b"]\n", "expected a mapping of profile keys, got <a list of 1000"),
    (b"partition: " + b"p " * 3000 + b"\n", "partition='p p p"),
    (b"0\n", "expected a mapping of profile keys, got '0'"),
    (b"exclusive: maybe\n", "p.yaml: exclusive='maybe' is not allowed: expected true or false"),
    (b"exclusive: [yes]\n", "p.yaml: exclusive=['yes'] is not allowed: expected a single"),
    (b"mem: 1.5G\n", "mem='1.5G' is not allowed: expected memory per node"),
    (b"qos: [a, b]\n", "p.yaml: qos=['a', 'b'] is not allowed: expected a single value"),
    (b"constraint: a100 ib\n", "constraint='a100 ib' is not allowed"),
    (b"sbatch_extra: {a: b}\n", "sbatch_extra={'a': 'b'} is not allowed: expected a list"),
    (b'sbatch_extra: ["--x=a\\nb"]\n', "sbatch_extra '--x=a\\nb' is not allowed: an #SBATCH "
     "line cannot carry '\\n'"),
    (b'sbatch_extra: "--x=a\\0b"\n', "sbatch_extra '--x=a\\x00b' is not allowed: an #SBATCH "
     "line cannot carry '\\x00'"),
    (b"sbatch_extra: [--no-kill]\n", "pyrecover sets --no-kill itself (cluster profile key "
     "spare_nodes"),
    (None, "cluster profile"),  # a folder
])
def test_a_hostile_cluster_profile_file_is_one_short_line(tmp_path, body, message):
    profile_path = tmp_path / "p.yaml"
    if body is None:
        profile_path.mkdir()
    else:
        profile_path.write_bytes(body)
    done = launch(tmp_path, "--cluster", str(profile_path), "--dry-run")
    lines = [line for line in done.stderr.splitlines() if not line.startswith("note: ")]
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], lines
    assert len(lines[0]) < 400 and done.stdout == ""
    if body is None:
        assert "is a folder, not a YAML file" in lines[0]


def test_a_cluster_profile_of_comments_only_is_the_defaults(tmp_path):
    (tmp_path / "p.yaml").write_text("---\n# partition: gpu\n")
    done = launch(tmp_path, "--cluster", str(tmp_path / "p.yaml"), "--launcher", "none",
                  "--dry-run")
    assert done.returncode == 0, done.stderr
    assert "#SBATCH --ntasks-per-node=4" in done.stdout  # the built-in 4 GPUs per node


def test_missing_sbatch_points_at_dry_run(tmp_path):
    done = launch(tmp_path, "--launcher", "none", env={"PATH": "/nonexistent"})
    assert done.returncode == 2
    assert "sbatch not found on PATH" in done.stderr and "--dry-run" in done.stderr


def test_dry_run_prints_script_and_sbatch_command_and_writes_nothing(tmp_path):
    done = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run", "--mode", "vanilla",
                  "--exp-name", "dry")
    assert done.returncode == 0, done.stderr
    run_dir = tmp_path / "store" / "dry"
    assert done.stdout.startswith("#!/bin/bash\n")
    assert f"#   sbatch --parsable {run_dir / 'job.sbatch'}\n" in done.stdout
    assert f"--config {run_dir / 'run.yaml'}" in done.stdout
    assert (f'srun --kill-on-bad-exit=1 --nodelist="$STEP_NODES" --nodes="$NODES" --ntasks=4 '
            '--cpus-per-task=1 '
            f'\\\n        {sys.executable} -m pyrecover') in done.stdout
    assert files_under(tmp_path) == []


def test_an_image_that_is_not_there_is_refused_and_a_dry_run_says_so(tmp_path):
    missing = tmp_path / "pyrecover.sif"
    done = launch(tmp_path, "--image", str(missing))  # the built-in profile: srun apptainer
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        f"error: image '{missing}' does not exist: build it with `make image`"), done.stderr
    assert files_under(tmp_path) == []
    dry = launch(tmp_path, "--image", str(missing), "--dry-run")
    assert dry.returncode == 0 and dry.stdout.startswith("#!/bin/bash\n"), dry.stderr
    assert f"note: image '{missing}' does not exist here: a launch from this machine would " \
        "refuse it" in dry.stderr
    missing.write_bytes(b"")  # there: no note
    dry = launch(tmp_path, "--image", str(missing), "--dry-run")
    assert dry.returncode == 0 and "note: image" not in dry.stderr, dry.stderr


def test_restarts_in_the_job_without_spare_nodes_are_noted_as_having_no_effect(tmp_path):
    image = tmp_path / "x.sif"
    image.write_bytes(b"")
    idle = "note: --max-restarts-in-job has no effect without spare nodes"
    dry = launch(tmp_path, "--image", str(image), "--max-restarts-in-job", "3", "--dry-run")
    assert dry.returncode == 0 and idle in dry.stderr, dry.stderr
    dry = launch(tmp_path, "--image", str(image), "--max-restarts-in-job", "3",
                 "--spare-nodes", "1", "--dry-run")
    assert dry.returncode == 0 and idle not in dry.stderr, dry.stderr


def test_with_no_image_set_a_launch_is_refused_and_a_dry_run_shows_the_image_make_builds(
        tmp_path):
    """The README's first launch, typed before `make image`: a dry run used to be refused like
    the launch itself, so the script could not be looked at until an image existed."""
    done = launch(tmp_path)  # the built-in profile: srun in a container, no image named
    assert done.returncode == 2 and not done.stdout, done.stderr
    assert done.stderr.splitlines()[-1].startswith(
        "error: launcher srun runs the tasks in a container but no image is set"), done.stderr
    dry = launch(tmp_path, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    sif = tmp_path / "pyrecover.sif"  # where `make image` builds it, beside the command
    assert f"note: no image is set: the script names {sif}, which `make image` builds here" \
        in dry.stderr
    assert f" {sif} \\\n" in dry.stdout  # the apptainer exec line
    assert files_under(tmp_path) == []
    sif.write_bytes(b"")  # built: found by the launch itself, and no note
    dry = launch(tmp_path, "--dry-run")
    assert dry.returncode == 0 and "note: no image" not in dry.stderr, dry.stderr
    assert f" {sif} \\\n" in dry.stdout


def test_dry_run_output_is_itself_a_valid_script(tmp_path):
    done = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run")
    shellcheck(done.stdout, tmp_path)


def test_a_secret_in_the_environment_never_reaches_the_script(tmp_path):
    secret = "wandb-secret-0123456789abcdef"
    env = {"WANDB_API_KEY": secret, "HF_TOKEN": secret + "-hf"}
    for launcher in ("srun", "torchrun", "none"):
        done = launch(tmp_path, "--cluster", str(LOCAL), "--launcher", launcher,
                      "--image", "any.sif", "--dry-run", "--set", "tracking.wandb=online",
                      env=env)
        assert done.returncode == 0, done.stderr
        assert "#!/bin/bash" in done.stdout
        assert secret not in done.stdout + done.stderr


def test_relative_paths_become_absolute_for_the_job(tmp_path):
    cfg = config_mod.load(TINY, ["run.storage=runs", "data.path=../data/c.parquet"])
    absolute = render.absolute_paths(cfg, "/home/u/proj")
    assert absolute.run.storage == "/home/u/proj/runs"
    assert absolute.data.path == "/home/u/data/c.parquet"
    assert absolute.run_dir() == Path("/home/u/proj/runs/tiny")


def test_a_launch_over_a_run_a_local_train_made_records_absolute_paths(tmp_path, monkeypatch):
    """A local `train` recorded run.storage and data.path as typed (relative); the job a later
    `launch` submits starts in the run directory, where those would point nowhere. They are
    recorded absolute from the first start on (a `--config run.yaml` restart from another
    folder took a relative data.path from there)."""
    from pyrecover.experiment import prepare_run_dir
    from pyrecover.rundir import RunDir

    monkeypatch.chdir(tmp_path)
    local = config_mod.load(TINY, ["run.storage=runs", "data.path=data/c.parquet"])
    run = RunDir(local.run_dir())
    prepare_run_dir(local, run)
    first = config_mod.load(run.config)
    assert (first.data.path, first.run.storage) == (str(tmp_path / "data" / "c.parquet"),
                                                    str(tmp_path / "runs"))
    prepare_run_dir(config_mod.from_dict(config_mod.to_dict(
        render.absolute_paths(local, tmp_path))), run)
    recorded = config_mod.load(run.config)
    assert recorded.data.path == str(tmp_path / "data" / "c.parquet")
    assert recorded.run.storage == str(tmp_path / "runs")
    prepare_run_dir(local, run)  # a later local start keeps the absolute form
    assert config_mod.load(run.config).data.path == str(tmp_path / "data" / "c.parquet")


def test_launching_a_run_already_past_max_steps_says_the_job_would_end_at_once(tmp_path):
    from pyrecover.checkpoint import store

    run = tmp_path / "store" / "dry"
    pending = store.begin(run / "checkpoints", 100)
    with pending.open("state.pt") as f:
        f.write(b"weights")
    pending.commit("vanilla", 1, {"step": 100})
    (run / "checkpoints" / "step-200").mkdir()  # no manifest: no checkpoint
    said = [line for line in launch(tmp_path, "--cluster", str(LOCAL), "--dry-run",
                                    "--exp-name", "dry").stderr.splitlines()
            if "newest checkpoint" in line]
    assert said == ["note: the run's newest checkpoint is at step 100, at or past "
                    "train.max_steps=30: the job will end at once (--set train.max_steps=N "
                    "to train on)"]
    done = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run", "--exp-name", "dry",
                  "--set", "train.max_steps=101")
    assert done.returncode == 0 and "newest checkpoint" not in done.stderr, done.stderr


def test_dry_run_refuses_what_the_launch_would_refuse_and_writes_nothing(tmp_path):
    """A dry run over a run its config changes (or over a sweep's folder) printed a script the
    real launch then refused."""
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "store" / "dry")
    run.create()
    run.config.write_text(config_mod.dump(config_mod.load(TINY, [
        f"run.storage={tmp_path / 'store'}", f"data.path={tmp_path / 'data.parquet'}",
        "run.exp_name=dry"])))
    before = files_under(tmp_path)
    ok = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run", "--exp-name", "dry")
    assert ok.returncode == 0, ok.stderr
    done = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run", "--exp-name", "dry",
                  "--set", "model.n_layer=3")
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and not done.stdout, done.stderr
    assert lines[-1].startswith(f"error: {run.root} was started with another config "
                                "(model.n_layer: 2 -> 3)"), done.stderr
    (tmp_path / "store" / "sw").mkdir()
    (tmp_path / "store" / "sw" / "sweep.yaml").write_text("name: sw\n")
    done = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run", "--exp-name", "sw")
    assert done.returncode == 2 and "holds a sweep" in done.stderr, done.stderr
    assert [p for p in files_under(tmp_path) if p not in before] == [
        Path("store/sw"), Path("store/sw/sweep.yaml")]


def test_launch_never_imports_torch(tmp_path):
    env = dict(os.environ)
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "pyrecover", "launch", "--config", str(TINY),
         "--cluster", str(LOCAL), "--dry-run"],
        capture_output=True, text=True, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    imported = [line.split("|")[-1].strip() for line in done.stderr.splitlines()
                if line.startswith("import time:")]
    assert "pyrecover.slurm.render" in imported
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")]


@pytest.mark.parametrize("recorded, decision, code", [
    ("stop", "requeue", 75),      # srun's 143: SLURM ended a rank still shutting down
    ("error", "no_requeue", 2),
    (None, "requeue", 143),       # nothing recorded: a crash
])
def test_a_task_ended_by_slurm_after_the_trainer_decided_keeps_the_trainers_outcome(
        tmp_path, recorded, decision, code):
    spec = spec_for("srun", sets=[*TINY_SETS, f"run.storage={tmp_path / 'store'}"])
    spec.run.root.mkdir(parents=True)
    other_job = {"event": "stop", "time": 1, "job_id": "99", "restart_count": 1, "host": "h"}
    lines = [json.dumps(other_job)]
    if recorded:
        lines.append(json.dumps({"event": recorded, "time": 2, "step": 4, "job_id": "123",
                                 "restart_count": 1, "host": "h"}))
    spec.run.events.write_text("\n".join(lines) + "\n")
    _, stderr, exit_code = run_step(render.render(spec), tmp_path, exit_code=143,
                                    env={"SLURM_RESTART_COUNT": "1"})
    decided = json.loads(spec.run.events.read_text().splitlines()[-1])
    assert (decided["event"], decided["exit_code"]) == (decision, code), stderr
    assert exit_code == code


# ----------------------------------------------------------- a trailing newline in a name


@pytest.mark.parametrize("how", ["yaml", "option"])
def test_a_name_with_a_trailing_newline_is_refused_by_launch_dry_run(tmp_path, how):
    # `$` in re.match accepts "x\n": the newline ended the #SBATCH line, and the quoting of
    # every later line shifted so that text in run.storage ran in the batch shell.
    name = "abc\n"
    if how == "yaml":
        cfg = tmp_path / "exp.yaml"
        cfg.write_text(TINY.read_text().replace("exp_name: tiny", f"exp_name: {json.dumps(name)}"))
        done = pyrecover("launch", "--config", str(cfg), "--cluster", str(LOCAL), "--dry-run",
                         "--set", f"run.storage={tmp_path / 'store'}", cwd=tmp_path)
    else:
        done = launch(tmp_path, "--cluster", str(LOCAL), "--dry-run", "--exp-name", name)
    if how == "option":  # --set and --exp-name read the value as YAML, which drops the newline
        assert done.returncode == 0 and "#SBATCH --job-name=abc\n" in done.stdout
        return
    assert done.returncode == 2, done.stdout
    assert done.stderr.count("\n") == 1 and "run.exp_name='abc\\n'" in done.stderr
    assert done.stdout == "" and files_under(tmp_path) == [Path("exp.yaml")]


@pytest.mark.parametrize("field, value", [
    ("job_name", "abc\n"), ("job_name", "a\rb"), ("run_dir", "/scratch/x\n"),
    ("partition", "gpu\n"), ("account", "a\x00b"), ("time", "10\n"),
])
def test_every_sbatch_value_is_checked_even_past_config_validation(field, value):
    spec = dataclasses.replace(spec_for("srun"), **{field: value})
    with pytest.raises(LaunchError, match="an #SBATCH line cannot carry"):
        render.render(spec)


def test_the_rendered_script_of_an_edge_name_runs_in_bash_and_runs_nothing_else(tmp_path):
    storage = tmp_path / f"st {HOSTILE}"
    spec = spec_for("srun", sets=[f"run.storage={storage}", "run.exp_name=a.b_c-9"])
    script = render.render(spec)
    for line, (key, value) in zip(sbatch_lines(script), render.sbatch_options(spec).items(),
                                  strict=True):
        assert bash_words(line) == [f"--{key}" if value is None else f"--{key}={value}"]
    argv, stderr, code = run_step(script, tmp_path)
    assert code == 0, stderr
    assert argv == expected_argv(spec)
    assert not list(tmp_path.rglob("pwned")) and not (tmp_path / "z").exists()


@pytest.mark.parametrize("answer, kept, code", [
    ("echo 'sbatch: error: Batch job submission failed: Invalid partition' >&2; exit 1",
     False, 2),  # the user's to fix
    ("sleep 30", True, 1),  # no answer in time: a job may be queued, which needs its folder
])
def test_a_job_sbatch_refused_leaves_no_run_folder_and_a_slow_one_is_said(
        tmp_path, monkeypatch, answer, kept, code):
    """sbatch refused the job (or SLURM is down): the new run folder, with run.yaml and
    job.sbatch, was left behind and status showed a run "not started" that had no job. A
    SLURM that does not answer is a fault of the cluster (exit 1), not a mistake (2)."""
    from helpers import build_corpus

    build_corpus(tmp_path / "data.parquet", max_bytes=50_000)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", answer), ("squeue", "sleep 4")):  # slow, as when down
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {"PATH": f"{bin_dir}:{Path(sys.executable).parent}:/usr/bin:/bin",
           "PYRECOVER_SBATCH_TIMEOUT": "6"}
    done = launch(tmp_path, "--gpus-per-node", "2", "--launcher", "none", "--exp-name", "new",
                  env=env)
    assert done.returncode == code, done.stderr
    assert "pyrecover: waiting for SLURM (squeue) to answer" in done.stderr
    assert (tmp_path / "store" / "new").exists() is kept, done.stderr
    assert (tmp_path / "store").exists() is kept  # the storage folder it made for the run
