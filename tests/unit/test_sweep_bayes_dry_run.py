"""`sweep launch --dry-run` of a bayes sweep refuses what the launch itself refuses: a
relaunch whose experiment computes otherwise, a started trial whose recorded config does
not read. The wandb server is tests/wandb_standin.py (this machine cannot reach wandb's)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from helpers import TINY, default_cluster, pyrecover
from test_sweep_bayes import BAYES, GOOD, KEY, Wandb, launched

from pyrecover.sweep import agent, bayes

STANDIN = Path(__file__).resolve().parents[1] / "wandb_standin.py"


@pytest.fixture
def wandb_env(tmp_path):
    """The environment of a launch that wandb answers (the stand-in), with `sbatch` that
    answers job 77 and an empty queue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 77"), ("squeue", "true"), ("scontrol", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    server = subprocess.Popen([sys.executable, str(STANDIN), str(tmp_path / "requests.jsonl"),
                               "sw1", "2"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        yield {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
               "WANDB_MODE": "online", "WANDB_API_KEY": KEY,
               "WANDB_BASE_URL": f"http://127.0.0.1:{port}", **default_cluster(tmp_path)}
    finally:
        server.kill()
        server.wait()


def _relaunch(tmp_path: Path, env: dict, *sets: str, dry: bool) -> subprocess.CompletedProcess:
    path = tmp_path / "bo.yaml"
    path.write_text(yaml.safe_dump(BAYES))
    argv = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
            "--set", f"run.storage={tmp_path / 'st'}", "--set", "tracking.wandb=online",
            "--set", f"data.path={bayes.load_base(tmp_path / 'st' / 'bo').data.path}"]
    for item in sets:
        argv += ["--set", item]
    return pyrecover(*argv, *(["--dry-run"] if dry else []), cwd=tmp_path, env=env)


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("damage, message", [
    (None, "was launched with another experiment (model.n_layer"),
    ("trial-1/run.yaml", "trial-1/run.yaml (the trial's recorded config): "),
])
def test_a_dry_run_refuses_the_bayes_relaunch_the_launch_refuses(tmp_path, wandb_env, damage,
                                                                   message):
    """A bayes relaunch with another model.n_layer: `--dry-run` printed the script and exit 0,
    and the launch itself then refused it, below notes that had said all was well."""
    _, sweep_dir = launched(tmp_path)
    bayes.take(sweep_dir / "trial-1", Wandb(agent.Run("run1abc", GOOD)), world_size=1)
    sets = ["model.n_layer=3"] if damage is None else []
    if damage is not None:
        (sweep_dir / damage).write_text("train: [not, a, mapping\n")
    before = _snapshot(sweep_dir)
    said = []
    for dry in (True, False):
        done = _relaunch(tmp_path, wandb_env, *sets, dry=dry)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1, (dry, done.stderr)
        assert message in lines[0], (dry, lines[0])
        said.append(lines[0])
        assert _snapshot(sweep_dir) == before, dry  # a refused launch changes nothing
    assert said[0] == said[1]
