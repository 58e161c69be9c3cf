"""Job scripts: rendered the same every time, quoted so bash reads every value literally,
accepted by shellcheck, running exactly the launcher's command and requeueing only what a
requeue can fix. The launch command's input checks are in test_launch_input.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import TINY
from sbatch_support import (
    HOSTILE,
    PYTHON,
    TINY_SETS,
    bash_words,
    check_golden,
    expected_argv,
    run_step,
    sbatch_lines,
    shellcheck,
    spec_for,
)

from pyrecover import config as config_mod
from pyrecover.dist import port_for_job
from pyrecover.slurm import LaunchError, profile, render
from pyrecover.slurm.render import JobSpec

# Job 123's first step, where the profile allows its default in-job restarts.
FIRST_PORT = port_for_job(123, 0, profile.ClusterProfile().max_restarts_in_job + 1)

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


@pytest.mark.parametrize("signal", ["TERM", "SIGUSR1", "int"])
def test_slurm_warns_with_the_runs_own_stop_signal(signal, tmp_path):
    spec = spec_for("srun", sets=[*TINY_SETS, f"run.stop_signal={signal}"])
    name = signal.upper().removeprefix("SIG")
    script = render.render(spec)
    assert f"--signal={name}@120" in sbatch_lines(script)
    # the batch shell's trap and the trainer wait for the same signal
    assert f"STOP_SIGNAL={name}" in script


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
                  "c10d", "--rdzv-endpoint", f"node1:{FIRST_PORT}", "--rdzv-id", "123", "-m",
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
    spec = spec_for("srun")
    _, stderr, _ = run_step(render.render(spec), tmp_path)
    steps = spec.max_restarts_in_job + 1  # the shell's arithmetic is port_for_job's
    assert f"rendezvous node1:{port_for_job(123, 0, steps)}" in stderr


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
