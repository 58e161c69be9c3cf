"""The sweep's wandb registration without a server: what would be sent, when nothing is
registered (offline, or a relaunch that reuses the recorded id), and the record that keeps the
id. The registration itself, against a stand-in server, is tests/slurm/test_sweep_wandb_e2e.py."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from helpers import TINY, default_cluster, pyrecover
from test_sweep import base_config

from pyrecover.sweep import SweepError, record, spec, trials, wandb_sweep

STANDIN = Path(__file__).resolve().parents[1] / "wandb_standin.py"
SWEEP = """\
method: grid
metric: {name: loss, goal: minimize}
max_parallel: 2
seed: 3
parameters:
  train.lr: {values: [1e-3, 3e-3]}
"""


def closed_port_url() -> str:
    """A URL where nothing listens: any attempt to reach wandb there fails at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def launch_parts(tmp_path, wandb_mode: str):
    path = tmp_path / "lr.yaml"
    path.write_text(SWEEP)
    sweep = spec.load(path)
    cfg = trials.base_for(sweep, base_config(str(tmp_path / "storage")))
    cfg.tracking.wandb = wandb_mode
    cfgs = trials.configs(sweep, cfg, trials.choose(sweep))
    rec = record.make(sweep, [trials.resolved(c, ["train.lr"]) for c in cfgs])
    return path, cfg.run_dir(), rec, cfgs


def test_the_config_sent_is_the_sweep_file_with_pyrecovers_keys_out_and_a_local_controller(
        tmp_path):
    path, _, _, _ = launch_parts(tmp_path, "offline")
    sent = wandb_sweep.sweep_config(path, "lr")
    want = {k: v for k, v in yaml.safe_load(SWEEP).items() if k not in ("max_parallel", "seed")}
    assert sent == {**want, "name": "lr", "controller": {"type": "local"}}


def test_an_offline_sweep_is_not_registered_and_its_trials_name_no_sweep(tmp_path):
    path, sweep_dir, rec, cfgs = launch_parts(tmp_path, "offline")
    env = {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": closed_port_url()}
    got_rec, got_cfgs = wandb_sweep.attach(path, sweep_dir, rec, cfgs, env)
    assert got_rec.wandb is None and got_rec == rec
    assert [c.tracking.sweep_id for c in got_cfgs] == ["", ""]


def test_a_relaunch_reuses_the_recorded_sweep_id_and_contacts_nothing(tmp_path):
    path, sweep_dir, rec, cfgs = launch_parts(tmp_path, "online")
    first = record.Record(**{**rec.__dict__, "wandb": {"sweep_id": "abc123", "url": None}})
    record.write(sweep_dir, first)
    assert record.read(sweep_dir).wandb == {"sweep_id": "abc123", "url": None}
    # online, with a key, and a server that would refuse the connection: not asked
    env = {"WANDB_API_KEY": "k" * 40, "WANDB_BASE_URL": closed_port_url()}
    got_rec, got_cfgs = wandb_sweep.attach(path, sweep_dir, rec, cfgs, env)
    assert got_rec.wandb["sweep_id"] == "abc123"
    assert [c.tracking.sweep_id for c in got_cfgs] == ["abc123", "abc123"]


def test_a_record_without_a_wandb_sweep_reads_back_as_none(tmp_path):
    _, sweep_dir, rec, _ = launch_parts(tmp_path, "offline")
    record.write(sweep_dir, rec)
    assert "wandb" not in yaml.safe_load((sweep_dir / record.RECORD).read_text())
    assert record.read(sweep_dir).wandb is None


def launch_online(tmp_path, path, bin_dir, port):
    """`sweep launch` of `path` with tracking.wandb=online against the stand-in at `port`."""
    return pyrecover("sweep", "launch", str(path), "--config", str(TINY), "--launcher", "none",
                     "--set", f"run.storage={tmp_path / 'st'}", "--set", "tracking.wandb=online",
                     cwd=tmp_path, env={"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                                        "WANDB_MODE": "online", "WANDB_API_KEY": "k" * 40,
                                        "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
                                        **default_cluster(tmp_path)})


def marking_sbatch(tmp_path: Path) -> tuple[Path, Path]:
    """marking_sbatch is a folder with a stand-in sbatch that leaves a mark (SUBMITTED) if
    called, and the sweep file to launch."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path / 'SUBMITTED'}\necho 77\n")
    (bin_dir / "sbatch").chmod(0o755)
    path = tmp_path / "lr.yaml"
    path.write_text(SWEEP)
    return bin_dir, path


def test_a_key_the_server_refuses_is_one_line_and_nothing_is_written_or_submitted(tmp_path):
    """sbatch is a stand-in that leaves a mark if called; the wandb server is
    tests/wandb_standin.py refusing the key (401), as wandb answers a wrong one."""
    bin_dir, path = marking_sbatch(tmp_path)
    server = subprocess.Popen([sys.executable, str(STANDIN), str(tmp_path / "requests.jsonl"),
                               "-"], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        done = launch_online(tmp_path, path, bin_dir, port)
    finally:
        server.kill()
        server.wait()
    assert (tmp_path / "requests.jsonl").read_text()  # it was asked, and refused
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: wandb did not register the sweep (")
    assert "user is not logged in" in done.stderr and done.stderr.count("\n") == 1
    assert not (tmp_path / "st").exists() and not (tmp_path / "SUBMITTED").exists()


class FailingServer(http.server.BaseHTTPRequestHandler):
    """A wandb server that answers, but fails: HTTP 500 to every request (an outage)."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(500)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST  # noqa: N815

    def log_message(self, *args) -> None:
        pass


def test_a_server_that_fails_is_a_fault_exit_1_not_the_keys_and_nothing_is_written(tmp_path):
    """wandb raises the same AuthenticationError for a failing server as for a wrong key; the
    key is fine here, so the same launch may work later: exit 1, not 2."""
    bin_dir, path = marking_sbatch(tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FailingServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        done = launch_online(tmp_path, path, bin_dir, server.server_address[1])
    finally:
        server.shutdown()
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith("error: wandb did not register the sweep: its server "
                                  f"http://127.0.0.1:{server.server_address[1]} answers HTTP "
                                  "500, a fault of the server, not of the key;")
    assert done.stderr.count("\n") == 1
    assert not (tmp_path / "st").exists() and not (tmp_path / "SUBMITTED").exists()


def test_a_launch_refused_for_its_folder_registers_no_sweep_with_wandb(tmp_path):
    """A sweep named like a run of the same storage is refused; wandb used to be asked
    first, leaving a registered sweep that no trial would ever join."""
    from pyrecover.rundir import RunDir

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("sbatch", "echo 77"), ("squeue", "exit 0")):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    RunDir(tmp_path / "st" / "lr").create()
    RunDir(tmp_path / "st" / "lr").event("start", step=0)
    path = tmp_path / "lr.yaml"
    path.write_text(SWEEP)
    requests = tmp_path / "requests.jsonl"
    server = subprocess.Popen([sys.executable, str(STANDIN), str(requests), "sweep01"],
                              stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        done = launch_online(tmp_path, path, bin_dir, port)
    finally:
        server.kill()
        server.wait()
    assert done.returncode == 2 and "holds a run" in done.stderr, done.stderr
    asked = requests.read_text() if requests.exists() else ""
    assert "UpsertSweep" not in asked


def test_a_relaunch_may_rank_a_grid_by_another_metric_but_not_a_bayes_controller(tmp_path):
    path, sweep_dir, rec, _ = launch_parts(tmp_path, "offline")
    record.write(sweep_dir, rec)
    again = record.Record(**{**rec.__dict__, "metric": "tokens_per_s", "goal": "maximize"})
    note = record.write(sweep_dir, again)
    assert note == ("note: sweep status now ranks the trials to maximize tokens_per_s "
                    "(was: minimize loss)")
    assert (record.read(sweep_dir).metric, record.read(sweep_dir).goal) == (
        "tokens_per_s", "maximize")
    assert record.write(sweep_dir, again) is None

    bayes = record.Record(**{**rec.__dict__, "method": "bayes", "trials": [],
                             "parameters": {"train.lr": {"min": 1e-4, "max": 1e-3}}})
    record.write(tmp_path / "b", bayes)
    other = record.Record(**{**bayes.__dict__, "metric": "grad_norm"})
    with pytest.raises(SweepError, match="chooses to minimize loss; give this sweep another"):
        record.write(tmp_path / "b", other)


@pytest.mark.parametrize("method", ["grid", "bayes"])
def test_online_with_no_server_is_a_fault_of_the_network_exit_1_and_nothing_is_written(
        tmp_path, method):
    """No relaunch would register a sweep launched offline, so it is not launched; but a
    server that does not answer is the network's fault, like a SLURM that does not answer
    (exit 1: type it again once it answers), not a mistake in the command (exit 2)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/bin/sh\ntouch {tmp_path / 'SUBMITTED'}\necho 77\n")
    (bin_dir / "sbatch").chmod(0o755)
    path = tmp_path / "lr.yaml"
    path.write_text(SWEEP.replace("method: grid", f"method: {method}").replace(
        "max_parallel: 2", "max_parallel: 2\nrun_cap: 2"))
    url = closed_port_url()
    done = launch_online(tmp_path, path, bin_dir, int(url.rsplit(":", 1)[1]))
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: wandb's server {url} does not answer from here"), \
        done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "st").exists() and not (tmp_path / "SUBMITTED").exists()


def test_the_sweep_files_project_and_entity_are_where_every_trial_logs_and_registers(
        tmp_path):
    """wandb's sweep format names the sweep's project and entity; they were accepted and
    ignored, so the sweep was registered under tracking.project and its trials logged there."""
    raw = {**yaml.safe_load(SWEEP), "project": "lr-study", "entity": "my-team"}
    sweep = spec.parse(raw, "lr")
    cfg = trials.base_for(sweep, base_config(str(tmp_path / "storage")))
    assert (cfg.tracking.project, cfg.tracking.entity) == ("lr-study", "my-team")
    for trial in trials.configs(sweep, cfg, trials.choose(sweep)):
        assert (trial.tracking.project, trial.tracking.entity) == ("lr-study", "my-team")
    plain = trials.base_for(spec.parse(yaml.safe_load(SWEEP), "lr"), base_config())
    assert (plain.tracking.project, plain.tracking.entity) == ("pyrecover", "")
    with pytest.raises(SweepError, match="project=3 is not allowed"):
        spec.parse({**raw, "project": 3}, "lr")
