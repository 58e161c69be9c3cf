"""Job scripts: rendered the same every time, quoted so bash reads every value literally,
accepted by shellcheck, free of secrets; and `pyrecover launch` refuses bad input with one
line before it writes or submits anything."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, TINY, default_cluster, pyrecover

from pyrecover import config as config_mod
from pyrecover.slurm import LaunchError, profile, render
from pyrecover.slurm.render import JobSpec, Shell

GOLDEN = REPO / "tests" / "golden"
IN_CI = os.environ.get("CI", "").lower() == "true"
LOCAL = REPO / "launch" / "clusters" / "local.yaml"
EXAMPLE = REPO / "launch" / "clusters" / "example-4gpu.yaml"
# Fixed paths, so the golden files do not depend on where the tests run.
PYTHON = "/opt/venv/bin/python"
FIXED_CWD = "/home/user/pyrecover"
TINY_SETS = ["run.storage=/scratch/pyrecover", "run.exp_name=tiny-gpt"]
# What the stand-in environment of `run_step` makes of each run-time word.
EXPANSIONS = {
    '--nodelist="$STEP_NODES"': "--nodelist=node1,node2",
    '--nodes="$NODES"': "--nodes=2",
    '--ntasks="$NODES"': "--ntasks=2",
    '"$NODES"': "2",
    '"$MASTER_ADDR:$MASTER_PORT"': "node1:10123",
    '"$SLURM_JOB_ID"': "123",
}
HOSTILE = "we ird 'q' \"dq\" $(touch pwned) `touch pwned` ; echo $HOME & x|y >z *"


def spec_for(launcher: str, sets: list[str] = TINY_SETS, **fields) -> JobSpec:
    cfg = render.absolute_paths(config_mod.load(TINY, sets), FIXED_CWD)
    prof = profile.ClusterProfile(**{
        "partition": "gpu", "account": "proj-42", "time": "1-00:00", "nodes": 2,
        "image": "/images/pyrecover.sif", "cpus_per_task": 8, "launcher": launcher, **fields})
    profile.validate(prof)
    return render.job_spec(cfg, prof, PYTHON)


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        if IN_CI:
            pytest.fail(f"{path} was missing; it has been generated: review and commit it")
        return
    assert text == path.read_text(), (
        f"rendered script differs from {path}; if the change is intended, delete "
        f"tests/golden/{name} to regenerate it and review the diff")


def shellcheck(script: str, tmp_path: Path, *exclude: str) -> None:
    if shutil.which("shellcheck") is None:
        if IN_CI:
            pytest.fail("shellcheck is not installed; CI must run it")
        pytest.skip("shellcheck is not installed")
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    excluded = [f"--exclude={','.join(exclude)}"] if exclude else []
    done = subprocess.run(["shellcheck", "--shell=bash", *excluded, str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def sbatch_lines(script: str) -> list[str]:
    return [line.removeprefix("#SBATCH ") for line in script.splitlines()
            if line.startswith("#SBATCH ")]


def bash_words(text: str) -> list[str]:
    """The words bash makes of `text` (quotes removed, nothing expanded by accident)."""
    done = subprocess.run(["bash", "-c", f"printf '%s\\0' {text}"], capture_output=True,
                          check=True)
    return done.stdout.decode().split("\0")[:-1]


def run_step(script: str, tmp_path: Path, exit_code: int = 0,
             env: dict[str, str] | None = None, srun_body: str = ""
             ) -> tuple[list[str], str, int]:
    """Run the script's shell part with `srun` and `scontrol` replaced by stand-ins.

    The `srun` stand-in records the argv it gets (apptainer and all, NUL-separated), runs
    `srun_body` and exits with `exit_code`; `scontrol show hostnames` answers node1, node2.
    Returns the argv, the script's stderr and its exit code.
    """
    bin_dir = tmp_path / "stand-in-bin"
    bin_dir.mkdir(exist_ok=True)
    argv_file = tmp_path / "srun.argv"
    record = f"printf '%s\\0' srun \"$@\" > {shlex.quote(str(argv_file))}"
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{record}\n{srun_body}\nexit {exit_code}\n")
    requeue = shlex.quote(str(tmp_path / "scontrol.requeue"))
    (bin_dir / "scontrol").write_text(
        f"#!/bin/bash\nif [ \"$1\" = requeue ]; then echo \"$2\" >> {requeue}; exit 0; fi\n"
        "printf 'node1\\nnode2\\n'\n")
    for stub in bin_dir.iterdir():
        stub.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "SLURM_JOB_ID": "123",
           "SLURM_JOB_NODELIST": "node[1-2]", "SLURM_NNODES": "2", **(env or {})}
    path = tmp_path / "script.sh"
    path.write_text(script)
    done = subprocess.run(["bash", str(path)], env=env, cwd=tmp_path, capture_output=True,
                          text=True)
    argv = argv_file.read_bytes().decode().split("\0")[:-1] if argv_file.exists() else []
    return argv, done.stderr, done.returncode


def expected_argv(spec: JobSpec) -> list[str]:
    return [EXPANSIONS[w.text] if isinstance(w, Shell) else str(w)
            for w in render.train_argv(spec)]


# ---------------------------------------------------------------- golden files, shellcheck

GOLDEN_CASES = {
    "srun.sbatch": lambda: spec_for("srun"),
    "torchrun.sbatch": lambda: spec_for("torchrun"),
    "torchrun-no-image.sbatch": lambda: spec_for("torchrun", image=None),
    "none.sbatch": lambda: spec_for("none"),
    "spawn.sbatch": lambda: spec_for("spawn"),
}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_each_launcher_renders_its_golden_script(name):
    check_golden(name, render.render(GOLDEN_CASES[name]()))


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_shellcheck_accepts_every_rendered_script(name, tmp_path):
    shellcheck(render.render(GOLDEN_CASES[name]()), tmp_path)


def test_rendering_is_deterministic():
    assert render.render(spec_for("srun")) == render.render(spec_for("srun"))


def test_sbatch_lines_are_sorted_and_hold_the_job_shape():
    lines = sbatch_lines(render.render(spec_for("srun")))
    assert lines == sorted(lines)
    assert lines == [
        "--account=proj-42", "--chdir=/scratch/pyrecover/tiny-gpt", "--cpus-per-task=8",
        "--error=/scratch/pyrecover/tiny-gpt/logs/%j.out", "--gpus-per-node=4",
        "--job-name=tiny-gpt", "--nodes=2", "--ntasks-per-node=4", "--open-mode=append",
        "--output=/scratch/pyrecover/tiny-gpt/logs/%j.out", "--partition=gpu", "--requeue",
        "--signal=USR2@120", "--time=1-00:00",
    ]


def test_unset_partition_account_and_cpus_leave_no_sbatch_line():
    spec = dataclasses.replace(spec_for("srun"), partition=None, account=None,
                               cpus_per_task=None)
    keys = [line.split("=")[0] for line in sbatch_lines(render.render(spec))]
    assert not {"--partition", "--account", "--cpus-per-task"} & set(keys)


STEP = ("--nodelist=node1,node2", "--nodes=2")  # the step's nodes, chosen by the script


@pytest.mark.parametrize("launcher, command", [
    ("srun", ["srun", "--kill-on-bad-exit=1", *STEP, "--ntasks=8", "--cpus-per-task=8",
              "apptainer", "exec", "--nv",
              "--bind",
              "/scratch/pyrecover:/scratch/pyrecover", "/images/pyrecover.sif", "pyrecover",
              "train", "--config", "/scratch/pyrecover/tiny-gpt/run.yaml"]),
    ("none", ["srun", "--kill-on-bad-exit=1", *STEP, "--ntasks=8", "--cpus-per-task=8",
              PYTHON, "-m", "pyrecover",
              "train", "--config",
              "/scratch/pyrecover/tiny-gpt/run.yaml"]),
    ("torchrun", ["srun", "--kill-on-bad-exit=1", *STEP, "--ntasks=2",
                  "--ntasks-per-node=1", "--cpus-per-task=32", "apptainer", "exec", "--nv",
                  "--bind", "/scratch/pyrecover:/scratch/pyrecover", "/images/pyrecover.sif",
                  "python", "-m", "pyrecover.elastic_agent", "--stop-signal", "USR2",
                  "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-backend",
                  "c10d", "--rdzv-endpoint", "node1:10123", "--rdzv-id", "123", "-m",
                  "pyrecover", "train", "--config", "/scratch/pyrecover/tiny-gpt/run.yaml"]),
    ("spawn", ["srun", "--kill-on-bad-exit=1", *STEP, "--ntasks=2",
               "--ntasks-per-node=1", "--cpus-per-task=32", "apptainer", "exec", "--nv",
               "--bind", "/scratch/pyrecover:/scratch/pyrecover", "/images/pyrecover.sif",
               "pyrecover", "train", "--config", "/scratch/pyrecover/tiny-gpt/run.yaml",
               "--nproc", "4"]),
])
def test_the_script_runs_exactly_the_launchers_command(launcher, command, tmp_path):
    argv, stderr, code = run_step(render.render(spec_for(launcher)), tmp_path)
    assert code == 0, stderr
    assert argv == command


def test_master_address_and_port_come_from_the_allocation(tmp_path):
    _, stderr, _ = run_step(render.render(spec_for("srun")), tmp_path)
    from pyrecover.dist import port_for_job

    assert f"rendezvous node1:{port_for_job(123)}" in stderr


@pytest.mark.parametrize("code, restart, decision", [
    (0, 0, None),                    # finished: nothing to decide
    (2, 0, "no_requeue"),            # config or data error: a requeue cannot fix it
    (75, 0, "requeue"),              # stopped cleanly with a checkpoint
    (1, 2, "requeue"),               # a crash while restarts remain (test_job_script.py)
])
def test_after_the_step_the_script_requeues_only_what_a_requeue_can_fix(tmp_path, code, restart,
                                                                         decision):
    spec = spec_for("srun", sets=[*TINY_SETS, f"run.storage={tmp_path / 'store'}"])
    spec.run.root.mkdir(parents=True)
    _, stderr, exit_code = run_step(render.render(spec), tmp_path, exit_code=code,
                                    env={"SLURM_RESTART_COUNT": str(restart)})
    assert exit_code == code, stderr
    assert f"training exited with code {code} (restart {restart}, 0 failures of at most 3," \
        in stderr
    requeued = (tmp_path / "scontrol.requeue").read_text().split() if (
        tmp_path / "scontrol.requeue").exists() else []
    events = [json.loads(line) for line in spec.run.events.read_text().splitlines()] if (
        spec.run.events.exists()) else []
    if decision is None:
        assert not events and not requeued
        return
    (event,) = events
    assert (event["event"], event["exit_code"], event["restart_count"], event["job_id"]) == (
        decision, code, restart, "123")
    assert requeued == (["123"] if decision == "requeue" else [])


# -------------------------------------------------------------------------- hostile input


def hostile_spec(tmp_path: Path) -> tuple[JobSpec, Path, Path, Path]:
    storage = tmp_path / f"storage {HOSTILE}"
    bind_src = tmp_path / f"bind\nnew line {HOSTILE}"
    image = tmp_path / f"image {HOSTILE}.sif"
    cfg = config_mod.load(TINY, [f"run.storage={storage}", f"data.path={storage}/d; rm x"])
    assert cfg.run.storage == str(storage)  # --set carried the value unchanged
    prof = profile.with_overrides(profile.ClusterProfile(), str(tmp_path), nodes=2,
                                  binds=(f"{bind_src}:/data $(touch pwned)",), image=str(image),
                                  partition="gpu", time="10")
    profile.validate(prof)
    return render.job_spec(cfg, prof, PYTHON), storage, bind_src, image


def test_hostile_sbatch_values_read_back_literally_through_bash(tmp_path):
    spec, storage, _, _ = hostile_spec(tmp_path)
    lines = sbatch_lines(render.render(spec))
    options = render.sbatch_options(spec)
    assert len(lines) == len(options)
    for line, (key, value) in zip(lines, options.items(), strict=True):
        expected = f"--{key}" if value is None else f"--{key}={value}"
        assert bash_words(line) == [expected]
    escaped = str(storage).replace("%", "%%")
    assert options["output"] == f"{escaped}/tiny/logs/%j.out"


def test_hostile_paths_reach_srun_literally_and_run_nothing(tmp_path):
    spec, storage, bind_src, image = hostile_spec(tmp_path)
    argv, stderr, code = run_step(render.render(spec), tmp_path)
    assert code == 0, stderr
    assert argv == expected_argv(spec)
    assert f"{storage}:{storage}" in argv
    assert f"{bind_src}:/data $(touch pwned)" in argv
    assert str(image) in argv and f"{storage}/tiny/run.yaml" in argv
    assert not list(tmp_path.rglob("pwned")) and not (tmp_path / "z").exists()


def test_shellcheck_accepts_the_hostile_script(tmp_path):
    # SC2016 says "expressions don't expand in single quotes": exactly what the quoting is for.
    shellcheck(render.render(hostile_spec(tmp_path)[0]), tmp_path, "SC2016")


@pytest.mark.parametrize("name", [
    "a b", "it's", 'say"hi"', "$(reboot)", "`id`", "a;b", "a\nb", "../up", "a/b", "..",
])
def test_hostile_experiment_names_are_refused(name):
    with pytest.raises(config_mod.ConfigError, match="run.exp_name"):
        config_mod.load(TINY, [f"run.exp_name={name}"])


@pytest.mark.parametrize("storage, why", [
    ("/scratch/new\nline", "an #SBATCH line cannot carry '\\n'"),
    ("/scratch/back\\slash", "an #SBATCH line cannot carry '\\\\'"),
    ("/scratch/co:lon", "apptainer's --bind cannot carry ':' or ','"),
])
def test_storage_paths_sbatch_or_apptainer_cannot_carry_are_refused(storage, why):
    # Built directly: `--set` reads values as YAML, which folds a newline into a space.
    cfg = config_mod.load(TINY)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, storage=storage))
    prof = profile.ClusterProfile(image="/images/pyrecover.sif")
    with pytest.raises(LaunchError, match="run.storage") as info:
        render.job_spec(cfg, prof, PYTHON)
    assert why in str(info.value)


def test_a_percent_in_storage_is_escaped_for_slurms_filename_patterns():
    spec = spec_for("none", sets=["run.storage=/scratch/100%", "run.exp_name=x"])
    assert render.sbatch_options(spec)["output"] == "/scratch/100%%/x/logs/%j.out"


# ----------------------------------------------------------------------------- profiles


def test_the_shipped_profiles_load_and_validate():
    for path in (LOCAL, EXAMPLE):
        profile.validate(profile.load_profile(path, FIXED_CWD))
    local = profile.load_profile(LOCAL, FIXED_CWD)
    assert (local.partition, local.launcher, local.nodes) == ("debug", "none", 2)
    example = profile.load_profile(EXAMPLE, FIXED_CWD)
    assert example.gpus_per_node == 4 and example.image.endswith(".sif")
    assert example.binds == (profile.Bind("/scratch/datasets", "/scratch/datasets"),)


def test_an_unknown_profile_key_is_named_with_the_known_ones(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("partition: gpu\ngpus: 4\n")
    with pytest.raises(LaunchError) as info:
        profile.load_profile(path, tmp_path)
    message = str(info.value)
    assert "unknown cluster profile key 'gpus'" in message
    assert "gpus_per_node" in message and "signal_seconds" in message


def test_profile_times_stay_strings_even_where_yaml_would_read_base_60(tmp_path):
    path = tmp_path / "site.yaml"
    path.write_text("time: 1:00:00\nnodes: 3\ncpus_per_task: ~\nbinds: data\n")
    prof = profile.load_profile(path, tmp_path)
    assert (prof.time, prof.nodes, prof.cpus_per_task) == ("1:00:00", 3, None)
    assert prof.binds == (profile.Bind(str(tmp_path / "data"), str(tmp_path / "data")),)


def test_command_line_options_override_the_profile_and_add_binds(tmp_path):
    base = profile.load_profile(EXAMPLE, tmp_path)
    prof = profile.with_overrides(base, tmp_path, binds=("rel:/in",), nodes=3, time="30",
                                  partition=None, image="img.sif")
    assert (prof.nodes, prof.time, prof.partition) == (3, "30", "gpu")
    assert prof.image == str(tmp_path / "img.sif")
    assert prof.binds[-1] == profile.Bind(str(tmp_path / "rel"), "/in")


@pytest.mark.parametrize("text, seconds", [
    ("30", 1800), ("90:30", 5430), ("2:00:00", 7200), ("1-0", 86400), ("1-2", 93600),
    ("1-02:30", 95400), ("2-00:00:10", 172810), ("infinite", None), ("UNLIMITED", None),
    ("-1", None), ("0", None),
])
def test_slurm_time_forms_are_accepted(text, seconds):
    assert profile.time_seconds(text) == seconds


@pytest.mark.parametrize("text", ["", "1:2:3:4", "1h", "1-", "-1-2", "1-2:3:4:5", "1.5",
                                  "1 day", "forever", "1-02:30\n"])
def test_time_strings_slurm_rejects_are_refused(text):
    with pytest.raises(LaunchError, match="time="):
        profile.time_seconds(text)


@pytest.mark.parametrize("bind", ["", ":/x", "a:", "a:rel", "a:/b:/c", "a,b", "a:/b:ro:x"])
def test_malformed_binds_are_refused(bind):
    with pytest.raises(LaunchError, match="bind"):
        profile.parse_bind(bind, "/cwd")


def test_binds_are_absolute_with_the_destination_spelled_out():
    assert profile.parse_bind("data", "/cwd") == profile.Bind("/cwd/data", "/cwd/data")
    assert profile.parse_bind("/d:/in:ro", "/cwd").spec() == "/d:/in:ro"


def test_launcher_srun_without_an_image_says_what_to_do():
    with pytest.raises(LaunchError, match="--image"):
        spec_for("srun", image=None)


# ----------------------------------------------------------------- the launch command


def launch(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """`pyrecover launch` the tiny run; the cluster profile is the built-in defaults (an
    empty file beside tmp_path) unless the test passes --cluster."""
    base = ["launch", "--config", str(TINY), "--set", f"run.storage={tmp_path / 'store'}",
            "--set", f"data.path={tmp_path / 'data.parquet'}"]
    env = {**default_cluster(tmp_path), **(env or {})}
    return pyrecover(*base, *args, env=env, cwd=tmp_path)


def files_under(path: Path) -> list[Path]:
    return sorted(p.relative_to(path) for p in path.rglob("*"))


@pytest.mark.parametrize("args, message", [
    (["--nodes", "0"], "nodes=0 is not allowed: expected an integer >= 1"),
    (["--gpus-per-node", "3"], "train.global_batch_size=8 is not allowed"),
    (["--time", "1:2:3:4"], "time='1:2:3:4' is not allowed"),
    (["--time", "2"], "time='2' is not allowed: expected a limit longer than signal_seconds"),
    (["--launcher", "mpirun"], "launcher='mpirun' is not allowed: expected one of srun"),
    (["--image", "missing.sif", "--launcher", "srun"], "image "),
    (["--cluster", "nowhere.yaml"], "cluster profile 'nowhere.yaml' does not exist"),
    (["--cluster", "bad.yaml"], "unknown cluster profile key 'gpus'; known keys: account"),
    (["--exp-name", "a b"], "run.exp_name='a b'"),
    (["--exp-name", "x;$(reboot)"], "run.exp_name="),
    (["--mode", "nonsense"], "checkpoint.mode='nonsense'"),
    (["--bind", "a:relative"], "must be an absolute path inside the container"),
    (["--launcher", "none"], "sbatch not found on PATH"),
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
