"""Experiment tracking with real wandb offline runs: one run id across a kill and a resume."""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import time
from pathlib import Path

import pytest
from helpers import pyrecover, tiny_args

from pyrecover import config as config_mod
from pyrecover import tracking
from pyrecover.preempt import EXIT_STOPPED
from pyrecover.rundir import RunDir


def wandb_records(path: Path):
    """wandb_records reads a `.wandb` transaction log (wandb's LevelDB-style record framing).

    A killed run may leave a torn last record; reading stops there, as `wandb sync` does.
    """
    for _end, record in framed(path):
        yield record


def framed(path: Path):
    """framed yields (the offset just past it, record) for each record of a `.wandb` log."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb transaction log"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _crc, size, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and size == 0:  # padding up to the next block
            pos += left
            continue
        if pos + 7 + size > len(data):
            break
        chunk = data[pos + 7:pos + 7 + size]
        pos += 7 + size
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):  # full record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(buf)
            yield pos, record


def history(path: Path) -> list[dict]:
    """history is every logged row of one offline run: {"_step": n, key: value, ...}."""
    rows = []
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            row = {"_step": record.history.step.num}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            rows.append(row)
    return rows


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def cut_after_step(path: Path, step: int) -> int:
    """cut_after_step truncates a transaction log just past its history record of `step` (or
    its last one before that), as a kill before wandb wrote the rest leaves it; returns the
    last step kept (0: none)."""
    kept, end = 0, 7
    for pos, record in framed(path):
        if record.WhichOneof("record_type") == "history":
            if record.history.step.num > step:
                break
            kept, end = record.history.step.num, pos
    with path.open("r+b") as f:
        f.truncate(end)
    return kept


def test_a_killed_and_resumed_run_keeps_one_wandb_run_with_every_step_once(tmp_path, corpus):
    args = ["train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=20",
                                "tracking.wandb=offline", "tracking.tags=a,b")]
    killed = pyrecover(*args, env={"PYRECOVER_KILL_AT_STEP": "15"})
    assert killed.returncode == -9, killed.stderr
    run_dir = tmp_path / "run"
    run_id = (run_dir / "wandb" / tracking.RUN_ID_FILE).read_text().strip()
    (first,) = offline_runs(run_dir)
    # What wandb had written when the kill came varies; a kill that took steps 13-15 with it
    # (a lost node takes wandb's buffers too) is made certain by cutting its log there.
    kept = cut_after_step(first / f"run-{run_id}.wandb", 12)
    resumed = pyrecover(*args)
    assert resumed.returncode == 0, resumed.stderr
    assert f"wandb run {run_id} resumed" in resumed.stderr

    first, second = offline_runs(run_dir)  # one folder per start, both with the same id
    assert first.name.endswith(f"-{run_id}") and second.name.endswith(f"-{run_id}")
    before = [row["_step"] for row in history(first / f"run-{run_id}.wandb")]
    after = history(second / f"run-{run_id}.wandb")
    steps = [row["_step"] for row in after]
    # The steps 11-15 redone after the kill are logged where the killed start's wandb had not
    # written them (from the checkpoint's step 10 on at the least): every step once, in order.
    assert before == list(range(1, kept + 1))
    assert steps == list(range(max(kept, 10) + 1, 21))
    assert after[0]["loss"] > 0 and after[0]["restart/count"] == 1
    assert after[0]["restart/steps_lost"] == 5 and after[0]["restart/cause_killed"] == 1
    assert any(row.get("checkpoint/step") == 20 for row in after)
    # The summary holds the goodput ledger: of the attempts before this start, and once the
    # run closes, of this one too.
    books = []
    for record in wandb_records(second / f"run-{run_id}.wandb"):
        if record.WhichOneof("record_type") == "summary":
            books += [json.loads(i.value_json) for i in record.summary.update
                      if i.key == "ledger"]
    at_start, at_close = books[0], books[-1]
    assert at_start["causes"]["lost_work"] > 0  # the steps after the checkpoint before the kill
    assert at_close["causes"]["lost_work"] == at_start["causes"]["lost_work"]
    assert at_close["causes"]["productive"] > at_start["causes"]["productive"]  # steps 16-20
    assert at_close["wall_seconds"] > at_start["wall_seconds"]
    for book in (at_start, at_close):
        assert abs(sum(book["causes"].values()) - book["wall_seconds"]) < 0.01


def closing_ledger(run_dir: Path) -> dict:
    """closing_ledger is the ledger in the summary the run's one offline wandb run closed with."""
    (folder,) = offline_runs(run_dir)
    (log_file,) = folder.glob("run-*.wandb")
    books = [json.loads(i.value_json) for record in wandb_records(log_file)
             if record.WhichOneof("record_type") == "summary"
             for i in record.summary.update if i.key == "ledger"]
    return books[-1]


@pytest.mark.parametrize("end", ["finish", "stop"])
def test_the_ledger_a_wandb_run_closes_with_holds_the_finish_or_the_stop(tmp_path, corpus, end):
    """The summary's ledger was computed before the trainer wrote its `finish` (its count of
    the checkpoint stall: the last save's left out) or its stop's records (the stop
    checkpoint's span left out): 0.0 s of stall where status said 0.081 s for a run stopped
    at its first step, 0.062 s against 0.083 s for a finished one."""
    argv = ["train", *tiny_args(tmp_path, corpus, "run", "tracking.wandb=offline",
                                "checkpoint.interval=3", "train.max_steps=" + (
                                    "12" if end == "finish" else "1000"))]
    # A stop without a signal: a job that ends now (preempt.Deadline) stops at the first step.
    stop = {"PYRECOVER_JOB_END_TIME": str(time.time()), "PYRECOVER_DEADLINE_MARGIN": "2"}
    done = pyrecover(*argv, env=stop if end == "stop" else None)
    assert done.returncode == (0 if end == "finish" else EXIT_STOPPED), done.stderr
    report = json.loads(pyrecover("status", str(tmp_path / "run"), "--json").stdout)
    assert report["restarts_by_cause"] == {} and report["state"] in (
        "finished", "stopped (resumes when started again)")
    stall = report["ledger"]["causes"]["checkpoint_stall"]
    assert stall > 0
    assert closing_ledger(tmp_path / "run")["causes"]["checkpoint_stall"] == stall


def _wandb_services() -> list[int]:
    """_wandb_services are the pids of this process's wandb-core children."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # it ended while we looked
            continue
        name, fields = text.split("(", 1)[1].rsplit(")", 1)[0], text.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and "wandb" in name and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def test_a_finished_tracker_leaves_its_log_whole_and_no_wandb_service_behind(tmp_path):
    """wandb's finish returns before its service has written the run's last records, and a
    trainer ends with os._exit (no atexit teardown): read right after, the log held no step
    (seen under load in CI). Once finish returns, the service is gone and the log whole."""
    cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=offline"])
    run = RunDir(cfg.run_dir())
    run.create()
    with tracking.start(cfg, run, rank=0) as tracker:
        assert _wandb_services(), "the offline run started no wandb service of ours"
        for step in (1, 2, 3):
            tracker.log(step, {"loss": 1.0 / step})
    assert _wandb_services() == []  # nothing is left to write the log after this
    records = list(wandb_records(next(offline_runs(run.root)[0].glob("run-*.wandb"))))
    assert [r.history.step.num for r in records if r.WhichOneof("record_type") == "history"] \
        == [1, 2, 3]
    assert records[-1].WhichOneof("record_type") == "exit"


def test_a_wandb_service_killed_with_the_job_step_never_changes_how_a_stop_ends(tmp_path):
    """SLURM signals every process of a step at preemption, wandb's service too; its teardown
    then calls sys.exit with the service's code, which replaced the stop in flight (75, to
    be requeued) with a crash code."""
    import signal

    from pyrecover.preempt import StopRequested

    cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=offline"])
    run = RunDir(cfg.run_dir())
    run.create()
    with pytest.raises(StopRequested):
        with tracking.start(cfg, run, rank=0) as tracker:
            tracker.log(1, {"loss": 1.0})
            for pid in _wandb_services():
                os.kill(pid, signal.SIGKILL)
            raise StopRequested(1, "USR2")
    assert _wandb_services() == []


def test_a_wandb_service_that_dies_mid_run_is_one_warning_and_training_goes_on(tmp_path,
                                                                                caplog):
    """wandb's service gone (it crashed, or the OOM killer took it) made the next log raise
    ConnectionResetError out of the training loop: the run ended with a crash and requeued,
    to meet the same fate, over a metrics logger."""
    import signal

    cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=offline"])
    run = RunDir(cfg.run_dir())
    run.create()
    with caplog.at_level(logging.WARNING, logger="pyrecover"):
        with tracking.start(cfg, run, rank=0) as tracker:
            tracker.log(1, {"loss": 1.0})
            for pid in _wandb_services():
                os.kill(pid, signal.SIGKILL)
            # wandb's client buffers what it sends: the loss of the connection shows at a
            # later log, however the machine schedules it. Training goes on until it does.
            deadline, step = time.monotonic() + 60.0, 1
            while tracker.enabled and time.monotonic() < deadline:
                step += 1
                tracker.log(step, {"loss": 1.0 / step})
                run.event("checkpoint", step=step)
                tracker.after_step(step)
                time.sleep(0.01)  # (a step's time: polls for the event, bounded above)
            assert not tracker.enabled
            tracker.log(step + 1, {"loss": 0.5})  # a no-op now, never an error
    said = [r.getMessage() for r in caplog.records if "wandb" in r.getMessage()]
    assert len(said) == 1 and "training goes on without it" in said[0], said
    assert f"wandb sync {run.wandb}" in said[0]


def test_other_ranks_get_a_disabled_tracker_and_create_nothing(tmp_path):
    cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=offline"])
    run = RunDir(cfg.run_dir())
    run.create()
    tracker = tracking.start(cfg, run, rank=1)
    tracker.log(1, {"loss": 1.0})
    tracker.after_step(1)
    tracker.finish()
    assert not tracker.enabled and not run.wandb.exists()


def test_a_disabled_tracker_creates_nothing_even_with_wandb_mode_set(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=disabled"])
    run = RunDir(cfg.run_dir())
    run.create()
    with tracking.start(cfg, run, rank=0) as tracker:
        tracker.log(1, {"loss": 1.0})
    assert not tracker.enabled and not run.wandb.exists()


def test_online_that_cannot_start_falls_back_offline_and_says_where_its_files_are(
        tmp_path, monkeypatch, caplog):
    """A server that answers but no API key: wandb's online start fails at once, the offline
    try starts, and the line said 'started: wandb', naming no folder to sync."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        for name in list(os.environ):
            if name.startswith("WANDB_"):
                monkeypatch.delenv(name)
        monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
        cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=online"])
        run = RunDir(cfg.run_dir())
        run.create()
        with caplog.at_level(logging.INFO, logger="pyrecover"):
            with tracking.start(cfg, run, rank=0) as tracker:
                assert tracker.enabled
                tracker.log(1, {"loss": 1.0})
    said = [r.getMessage() for r in caplog.records]
    assert any("wandb online could not start" in m and "trying offline" in m for m in said)
    where = f"started: {run.wandb} (offline; upload with: wandb sync {run.wandb})"
    assert any(m.startswith("wandb run ") and m.endswith(where) for m in said), said
    assert [row["_step"] for row in history(
        next(offline_runs(run.root)[0].glob("run-*.wandb")))] == [1]


FOREIGN = ['{"event": "resume", "step": "ten", "time": 5.0}', '{"step": "12", "loss": 1}',
           '{"event": "checkpoint", "step": 1e400, "time": "later"}', '[1, 2]', 'not json']


def test_foreign_lines_in_the_run_records_never_stop_a_tracked_start(tmp_path):
    """A hand-edited or foreign line in events.jsonl or metrics.jsonl is left out, as status
    leaves it out: a tracked start that failed on it would fail on every requeue."""
    cfg = config_mod.load(None, [f"run.storage={tmp_path}", "tracking.wandb=offline"])
    run = RunDir(cfg.run_dir())
    run.create()
    run.metric(step=7, loss=2.0)
    run.event("resume", step=5, steps_lost=2, restore_seconds=0.5)
    for path in (run.events, run.metrics):
        with path.open("a") as f:
            f.write("\n".join(FOREIGN) + "\n")
    with tracking.start(cfg, run, rank=0) as tracker:
        assert tracker.enabled
        tracker.log(8, {"loss": 1.5})
    rows = history(next(offline_runs(run.root)[0].glob("run-*.wandb")))
    assert [row["_step"] for row in rows] == [8]  # after the floor of the well-formed step 7
    assert rows[0]["restart/count"] == 1 and rows[0]["restart/steps_lost"] == 2


KEY = {"WANDB_API_KEY": "x" * 40}


@pytest.mark.parametrize("setting, environ, netrc_line, server_up, expected", [
    ("auto", {}, "", True, "offline"),
    ("auto", KEY, "", True, "online"),
    ("auto", KEY, "", False, "offline"),
    ("auto", {}, "machine api.wandb.ai login user password " + "y" * 40, True, "online"),
    ("auto", {**KEY, "WANDB_MODE": "offline"}, "", True, "offline"),
    ("auto", {"WANDB_MODE": "disabled"}, "", True, "disabled"),
    ("offline", {**KEY, "WANDB_MODE": "online"}, "", True, "offline"),
    ("disabled", {"WANDB_MODE": "online"}, "", True, "disabled"),
    ("online", KEY, "", True, "online"),
    ("online", KEY, "", False, "offline"),  # no 60-second wait for a server that is not there
])
def test_auto_goes_online_only_with_an_api_key_and_a_server_and_an_explicit_setting_wins(
        tmp_path, setting, environ, netrc_line, server_up, expected):
    netrc = tmp_path / "netrc"
    netrc.write_text(netrc_line + "\n")
    netrc.chmod(0o600)
    asked = []

    def reachable(url: str) -> bool:  # what the network would answer; no test goes out
        asked.append(url)
        return server_up

    assert tracking.resolve_mode(setting, environ, str(netrc), reachable) == expected
    assert asked in ([], ["https://api.wandb.ai"])


def test_each_restart_is_explained_by_the_last_event_before_it():
    events = [{"event": "start"}, {"event": "checkpoint", "step": 10},
              {"event": "resume", "step": 10, "steps_lost": 3},
              {"event": "crash", "error": "boom"}, {"event": "resume", "step": 20},
              {"event": "stop", "step": 25}, {"event": "requeue"},
              {"event": "resume", "step": 25, "restore_seconds": 0.5},
              {"event": "requeue"}, {"event": "resume", "step": 25},
              {"event": "finish", "step": 30}, {"event": "resume", "step": 30}]
    assert [(r["step"], r["cause"]) for r in tracking.restarts(events)] == [
        (10, "killed"), (20, "crash"), (25, "stop"), (25, "requeue"), (30, "continued")]


def test_starting_a_finished_run_again_opens_no_wandb_run_and_logs_no_restart(tmp_path,
                                                                               corpus):
    """A sweep relaunch starts every finished trial again, which ends at once: each used to
    write a new offline run with `restarts 1` and a `continued` restart, max_steps unchanged."""
    args = ["train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=4",
                                "tracking.wandb=offline")]
    assert pyrecover(*args).returncode == 0
    again = pyrecover(*args)
    assert again.returncode == 0, again.stderr
    assert "nothing to do: step 4 already reached" in again.stderr
    assert len(offline_runs(tmp_path / "run")) == 1
    longer = pyrecover(*args, "--set", "train.max_steps=6")  # raised: a continued run, logged
    assert longer.returncode == 0, longer.stderr
    assert len(offline_runs(tmp_path / "run")) == 2


def test_a_run_started_with_run_dir_keeps_its_wandb_name_when_restarted_from_run_yaml(
        tmp_path, corpus):
    """`train --run-dir DIR` records DIR's name as run.exp_name in run.yaml, but the first
    start named its wandb run (and logged its config) after the config's exp_name; the
    restart a job makes, `--config DIR/run.yaml`, renamed the same wandb run to DIR's name."""
    run_dir = tmp_path / "elsewhere"
    args = [*tiny_args(tmp_path, corpus, "tiny", "tracking.wandb=offline"),
            "--run-dir", str(run_dir)]
    first = pyrecover("train", *args, "--set", "train.max_steps=2")
    assert first.returncode == 0, first.stderr
    assert "config run: exp_name=elsewhere " in first.stderr
    again = pyrecover("train", "--config", str(run_dir / "run.yaml"),
                      "--set", "train.max_steps=4")
    assert again.returncode == 0, again.stderr
    names = [record.run.display_name for start in offline_runs(run_dir)
             for record in wandb_records(next(start.glob("run-*.wandb")))
             if record.WhichOneof("record_type") == "run"]
    assert names and set(names) == {"elsewhere"}, names
