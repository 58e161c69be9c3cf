"""A bayes sweep's whole path through wandb's own client: `sweep launch` registers the sweep,
and each trial's first start asks wandb's agent protocol for its values once. The wandb server
is tests/wandb_standin.py (a stand-in for it, which this machine cannot reach)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml
from helpers import TINY, default_cluster, pyrecover
from test_sweep_bayes import BAYES, KEY, launched

from pyrecover import config as config_mod
from pyrecover.rundir import read_jsonl
from pyrecover.sweep import status as sweep_status
from pyrecover.sweep import trials

STANDIN = Path(__file__).resolve().parents[1] / "wandb_standin.py"


def test_launch_registers_the_sweep_and_each_trial_asks_wandbs_agent_protocol_once(tmp_path):
    """`sbatch` is a stand-in that answers job 77; the wandb server is tests/wandb_standin.py,
    handing out 2 runs. The trial's step before training (`sweep values`, as the job script
    runs it) is run here by hand, twice: the second start asks nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 77"), ("squeue", "true"), ("scontrol", "exit 1")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    path = tmp_path / "bo.yaml"
    path.write_text(yaml.safe_dump({**BAYES, "run_cap": 2}))
    requests = tmp_path / "requests.jsonl"
    server = subprocess.Popen([sys.executable, str(STANDIN), str(requests), "sw1", "2"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
               "WANDB_MODE": "online", "WANDB_API_KEY": KEY,
               "WANDB_BASE_URL": f"http://127.0.0.1:{port}", **default_cluster(tmp_path)}
        argv = ["sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
                "--set", f"run.storage={tmp_path / 'st'}", "--set", "tracking.wandb=online"]
        dry = pyrecover(*argv, "--dry-run", cwd=tmp_path, env=env)
        assert dry.returncode == 0, dry.stderr
        assert "# --dry-run: nothing written or submitted. 2 trials (bayes, through wandb):\n" \
               "#   trial-0 .. trial-1: values from wandb's bayes controller at each trial's " \
               "first start\n# pyrecover would register the sweep with wandb" in dry.stdout
        assert "sweep values --world-size 4" in dry.stdout
        assert not (tmp_path / "st").exists() and not requests.exists()
        done = pyrecover(*argv, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        assert "submitted job array 77 (2 trials):\n  trial-0 .. trial-1: values from " \
               "wandb's bayes controller at each trial's first start" in done.stdout
        sweep_dir = tmp_path / "st" / "bo"
        script = (sweep_dir / "job.sbatch").read_text()
        assert "#SBATCH --array=0-1\n" in script
        assert (f"-m pyrecover sweep values --world-size 4 {sweep_dir}/trial-"
                '"$SLURM_ARRAY_TASK_ID"/ || after_training "$?"\n\nwhile :; do') in script
        assert not (sweep_dir / "trial-0" / "run.yaml").exists()

        trial = sweep_dir / "trial-0"
        starts = [pyrecover("sweep", "values", str(trial), "--world-size", "1", env=env)
                  for _ in range(2)]
    finally:
        server.kill()
    assert [s.returncode for s in starts] == [0, 0], starts[0].stderr + starts[1].stderr
    calls = [r for r in read_jsonl(requests) if r["path"] == "/graphql"]
    names = [r["query"].split("(")[0].split()[-1] for r in calls]
    assert names.count("UpsertSweep") == 1 and names.count("CreateAgent") == 1
    assert names.count("Heartbeat") == 1  # the second start asked nothing
    sent = yaml.safe_load(next(r for r in calls if "UpsertSweep" in r["query"])
                          ["variables"]["config"])
    assert "controller" not in sent and sent["method"] == "bayes"
    agent_call = next(r for r in calls if "CreateAgent" in r["query"])["variables"]
    assert (agent_call["sweep"], agent_call["projectName"]) == ("sw1", "pyrecover")
    assert agent_call["host"].endswith("-trial-0")
    (command,) = next(r for r in calls if "Heartbeat" in r["query"])["commands"]
    handed = {k: v["value"] for k, v in command["args"].items()}
    cfg = config_mod.load(trial / "run.yaml")
    assert trials.resolved(cfg, list(handed)) == handed
    assert (trial / "wandb" / "run-id").read_text().strip() == command["run_id"]
    assert "from wandb (run standinrun0)" in starts[0].stderr
    assert "as recorded at its first start (run standinrun0)" in starts[1].stderr
    assert KEY not in "".join(p.read_text() for p in sweep_dir.rglob("*") if p.is_file())
    report = json.loads(pyrecover("sweep", "status", str(sweep_dir), "--json").stdout)
    assert {t["index"]: t["state"] for t in report["trials"]}[1] == sweep_status.NO_VALUES


def test_wandb_that_cannot_be_asked_is_one_line_exit_1_and_nothing_is_recorded(tmp_path):
    """The stand-in refuses the key (401), as wandb answers a wrong one: the job requeues the
    trial (exit 1) while restarts remain, and its next start asks again."""
    _, sweep_dir = launched(tmp_path)
    server = subprocess.Popen([sys.executable, str(STANDIN), str(tmp_path / "r.jsonl"), "-"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        done = pyrecover("sweep", "values", str(sweep_dir / "trial-0"), env={
            "HOME": str(tmp_path), "WANDB_MODE": "online", "WANDB_API_KEY": KEY,
            "WANDB_BASE_URL": f"http://127.0.0.1:{port}"})
    finally:
        server.kill()
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: wandb did not hand out a run of sweep sw1 (")
    assert "user is not logged in" in lines[0]
    assert not (sweep_dir / "trial-0" / "run.yaml").exists()
