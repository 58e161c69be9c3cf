"""A bayes sweep on a real local SLURM cluster: launched online, it is registered with wandb
for wandb's controller, and each of its 2 trials (one job array, both at once) asks wandb's
agent protocol for its run once, at its first start, records the values and the run id, and
trains with them. tests/wandb_standin.py stands in for the wandb server: it registers the
sweep, hands out 2 runs whose values it picks from the sweep's parameters, and logs every
request. One trial is preempted with SIGUSR2 mid-run: it requeues and resumes with the same
values and run id without asking again (2 CreateAgent and 2 Heartbeat calls in all).

The trials' own wandb runs log offline: the stand-in answers the sweep's calls, not a run's.
The launch resolves `tracking.wandb: auto` online (a key, a server that answers); the job
gets WANDB_MODE=offline through SBATCH_EXPORT, so `auto` resolves offline in the trials, as
on a compute node where the runs are synced later. Asking for values does not depend on it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from localslurm import LocalSlurm
from test_requeue_e2e import events, kinds, last_step, launch_env, wait_for
from test_sweep_e2e import explain, preempt_and_finish, sweep_launch_argv, sweep_status
from test_sweep_wandb_e2e import carries_sweep, offline_runs

from pyrecover import config as config_mod
from pyrecover.rundir import read_jsonl
from pyrecover.sweep import trials

pytestmark = pytest.mark.slurm

STANDIN = Path(__file__).resolve().parents[1] / "wandb_standin.py"
SWEEP_ID = "pyrsw33p1d"
KEY = "k" * 40
SWEEP = """\
name: lr-bayes
method: bayes
metric: {name: loss, goal: minimize}
run_cap: 2
max_parallel: 2
parameters:
  train.lr: {distribution: log_uniform_values, min: 1e-3, max: 3e-3}
  train.warmup_steps: {values: [1, 2]}
"""
MAX_STEPS = 12  # at 1 s a step, the preempted trial has ~10 s left when it is signalled
SETS = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32",
        f"train.max_steps={MAX_STEPS}", "train.global_batch_size=4",
        "train.micro_batch_size=2", "train.log_interval=1", "checkpoint.interval=2",
        "tracking.wandb=auto")
PREEMPTED = 1


def calls(requests: Path, name: str) -> list[dict]:
    """calls are the stand-in's logged GraphQL requests of operation `name`."""
    return [r for r in read_jsonl(requests)
            if r["path"] == "/graphql" and re.search(rf"\b(query|mutation) {name}\b", r["query"])]


def test_a_bayes_sweep_gets_each_trials_values_from_wandb_once_and_a_requeue_reuses_them(
        local_slurm: LocalSlurm, corpus: Path, tmp_path: Path):
    (tmp_path / "sweep.yaml").write_text(SWEEP)
    requests = tmp_path / "requests.jsonl"
    server = subprocess.Popen([sys.executable, str(STANDIN), str(requests), SWEEP_ID, "2"],
                              stdout=subprocess.PIPE, text=True)
    array = None
    try:
        port = int(server.stdout.readline())
        env = launch_env(local_slurm, {
            "WANDB_API_KEY": KEY, "HOME": str(tmp_path), "PYRECOVER_STEP_DELAY": "1.0",
            "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
            "SBATCH_EXPORT": "ALL,WANDB_MODE=offline"})
        env.pop("WANDB_MODE", None)
        storage = tmp_path / "storage"
        argv = sweep_launch_argv(tmp_path / "sweep.yaml", storage, corpus, SETS)
        done = subprocess.run(argv, env=env, cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"wandb sweep {SWEEP_ID}: " in done.stdout
        array = done.stdout.split("submitted job array ")[1].split()[0]
        sweep_dir = storage / "lr-bayes"
        tasks = [f"{array}_{i}" for i in range(2)]
        preempted = sweep_dir / f"trial-{PREEMPTED}"
        wait_for(lambda: last_step(preempted) >= 2
                 and local_slurm.job_state(tasks[PREEMPTED]) == "RUNNING", 300,
                 "trial 1 at step 2",
                 lambda: explain(sweep_dir))
        preempt_and_finish(local_slurm, tasks, PREEMPTED, sweep_dir)
    finally:
        server.kill()
        if array is not None:
            local_slurm.cancel(array)

    # Registered for wandb's controller: no local controller in what was sent.
    (upsert,) = calls(requests, "UpsertSweep")
    sent = yaml.safe_load(upsert["variables"]["config"])
    assert sent["method"] == "bayes" and "controller" not in sent and sent["run_cap"] == 2
    # One agent and one heartbeat per trial: the requeued start asked nothing.
    agents, beats = calls(requests, "CreateAgent"), calls(requests, "Heartbeat")
    assert len(agents) == 2 and len(beats) == 2, explain(sweep_dir)
    assert sorted(a["variables"]["host"].rsplit("-", 1)[1] for a in agents) == ["0", "1"]
    handed = {c["run_id"]: {k: v["value"] for k, v in c["args"].items()}
              for b in beats for c in b["commands"]}
    assert len(handed) == 2

    for i, task in enumerate(tasks):
        trial = sweep_dir / f"trial-{i}"
        info = local_slurm.job_info(task)
        assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), explain(sweep_dir)
        run_id = (trial / "wandb" / "run-id").read_text().strip()
        cfg = config_mod.load(trial / "run.yaml")
        assert trials.resolved(cfg, ["train.lr", "train.warmup_steps"]) == handed[run_id]
        assert cfg.tracking.sweep_id == SWEEP_ID
        log = "".join(p.read_text() for p in (trial / "logs").glob("*.out"))
        assert log.count(f"from wandb (run {run_id})") == 1, log[-3000:]
        starts = offline_runs(trial)  # each start's wandb run: the handed-out id, in the sweep
        assert starts and all(r.name == f"run-{run_id}.wandb" and carries_sweep(r)
                              and b"train.lr" in r.read_bytes() for r in starts)
        if i == PREEMPTED:
            assert info["Restarts"] == "1"
            assert kinds(trial) == ["start", "stop", "requeue", "resume", "finish"]
            assert log.count(f"as recorded at its first start (run {run_id})") == 1
            assert len(starts) == 2
        else:
            assert info["Restarts"] == "0" and kinds(trial) == ["start", "finish"]
        assert [e["step"] for e in events(trial) if e["event"] == "finish"] == [MAX_STEPS]

    report = sweep_status(sweep_dir, env)
    assert {t["state"] for t in report["trials"]} == {"finished"}
    assert sorted(json.dumps(t["params"], sort_keys=True) for t in report["trials"]) == sorted(
        json.dumps(v, sort_keys=True) for v in handed.values())
    assert {t["index"]: t["restarts"] for t in report["trials"]} == {0: 0, 1: 1}

    # The key reached the trials through the environment only.
    holding = [p for p in sweep_dir.rglob("*") if p.is_file() and KEY.encode() in p.read_bytes()]
    assert not holding
