"""Shared by the job-script tests (test_render.py, test_launch_input.py): a fixed job spec,
golden files, shellcheck, and the script's shell part run with stand-ins for srun and
scontrol."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, TINY

from pyrecover import config as config_mod
from pyrecover.slurm import profile, render
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


