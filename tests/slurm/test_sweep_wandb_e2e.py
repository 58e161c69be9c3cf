"""A sweep launched with `tracking.wandb: online` is registered with wandb (through wandb's
own client, against tests/wandb_standin.py, which stands in for the wandb server and exits
once the sweep is registered), and every trial's wandb run carries the sweep's id: the trials
run on a real local SLURM cluster, find no server, log offline, and the run record each start
writes (what `wandb sync` uploads) names the sweep, under one run id per trial."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from localslurm import TERMINAL_STATES, LocalSlurm
from test_requeue_e2e import kinds, launch_env, wait_for
from test_sweep_e2e import explain, sweep_launch_argv

from pyrecover.rundir import read_jsonl

pytestmark = pytest.mark.slurm
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

STANDIN = Path(__file__).resolve().parents[1] / "wandb_standin.py"
SWEEP_ID = "pyrsw33p1d"
SWEEP = """\
name: lr-wandb
method: grid
metric: {name: loss, goal: minimize}
max_parallel: 2
seed: 0
description: two learning rates
parameters:
  train.lr: {values: [1e-3, 3e-3]}
  train.warmup_steps: {value: 1}
"""
SETS = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        "train.max_steps=4", "train.global_batch_size=4", "train.micro_batch_size=2",
        "checkpoint.interval=2", "tracking.wandb=online")


def offline_runs(trial: Path) -> list[Path]:
    """offline_runs are the `.wandb` record files of every start of the trial's run."""
    return sorted(trial.glob("wandb/offline-run-*/run-*.wandb"))


def carries_sweep(record_file: Path) -> bool:
    """True when the run record wandb wrote names the sweep (RunRecord.sweep_id, as encoded)."""
    return wandb_pb.RunRecord(sweep_id=SWEEP_ID).SerializeToString() in record_file.read_bytes()


def test_an_online_sweep_is_registered_with_wandb_and_every_trial_run_carries_its_id(
        local_slurm: LocalSlurm, corpus: Path, tmp_path: Path):
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    requests = tmp_path / "requests.jsonl"
    server = subprocess.Popen([sys.executable, str(STANDIN), str(requests), SWEEP_ID],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        env = launch_env(local_slurm, {"WANDB_API_KEY": "k" * 40, "HOME": str(tmp_path),
                                       "WANDB_BASE_URL": f"http://127.0.0.1:{port}"})
        env.pop("WANDB_MODE", None)
        storage = tmp_path / "storage"
        argv = sweep_launch_argv(tmp_path / "sweep.yaml", storage, corpus, SETS)
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert server.wait(timeout=60) == 0  # it registered one sweep and left
    finally:
        server.kill()
    assert (f"wandb sweep {SWEEP_ID}: http://127.0.0.1:{port}/standin/pyrecover/sweeps/"
            f"{SWEEP_ID}") in done.stdout

    # What the client sent: who am I, then the sweep as the file has it, pyrecover's own keys
    # (max_parallel, seed) left out, with the local controller: no agent is to get runs.
    calls = [r for r in read_jsonl(requests) if r["path"] == "/graphql"]
    assert ["Viewer" in calls[0]["query"], "mutation UpsertSweep" in calls[1]["query"],
            len(calls)] == [True, True, 2]
    sent = calls[1]["variables"]
    want = {k: v for k, v in yaml.safe_load(SWEEP).items() if k not in ("max_parallel", "seed")}
    assert yaml.safe_load(sent["config"]) == {**want, "controller": {"type": "local"}}
    assert (sent["projectName"], sent["entityName"], sent["id"]) == ("pyrecover", None, None)

    sweep_dir = storage / "lr-wandb"
    assert yaml.safe_load((sweep_dir / "sweep.yaml").read_text())["wandb"]["sweep_id"] == SWEEP_ID
    array = done.stdout.split("submitted job array ")[1].split()[0]
    tasks = [f"{array}_{i}" for i in range(2)]
    try:
        wait_for(lambda: all(local_slurm.job_state(t) in TERMINAL_STATES for t in tasks), 600,
                 "both trials ended", lambda: explain(sweep_dir))
    finally:
        local_slurm.cancel(array)

    for i in range(2):
        trial = sweep_dir / f"trial-{i}"
        assert kinds(trial) == ["start", "finish"], explain(sweep_dir)
        recorded = yaml.safe_load((trial / "run.yaml").read_text())["tracking"]
        assert recorded["sweep_id"] == SWEEP_ID
        run_id = (trial / "wandb" / "run-id").read_text().strip()
        (record,) = offline_runs(trial)
        assert record.name == f"run-{run_id}.wandb" and carries_sweep(record)

    # A restart of a trial (as a requeue runs it) continues the same wandb run, in the sweep.
    trial = sweep_dir / "trial-0"
    clean = {k: v for k, v in env.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    again = subprocess.run([sys.executable, "-m", "pyrecover", "train", "--config",
                            str(trial / "run.yaml"), "--set", "train.max_steps=6"],
                           env=clean, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    run_id = (trial / "wandb" / "run-id").read_text().strip()
    starts = offline_runs(trial)
    assert len(starts) == 2
    assert all(r.name == f"run-{run_id}.wandb" and carries_sweep(r) for r in starts)

    # The key reached the trials through the environment only: no file of the sweep holds it
    # (the job script, sweep.yaml, each run.yaml, logs, wandb's offline files).
    holding = [p for p in sweep_dir.rglob("*") if p.is_file() and b"k" * 40 in p.read_bytes()]
    assert not holding
