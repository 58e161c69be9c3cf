"""A mistake is said before torch is imported: seconds on a laptop, far more on a cluster's
login node, where torch comes off a shared file system. So are the answers of `ckpt ls --fast`
and of a run without checkpoints, which read manifests only."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers import TINY

from pyrecover.checkpoint import store
from pyrecover.cli.app import FAULTS, USER_ERRORS

# Runs the CLI as `python -m pyrecover` does, then says whether torch was imported.
PROBE = """
import runpy, sys
sys.argv = ["pyrecover", *sys.argv[1:]]
try:
    runpy.run_module("pyrecover", run_name="__main__")
    code = 0
except SystemExit as done:
    code = done.code
print(f"exit={code} torch={'torch' in sys.modules}")
"""


def run_cli(*args: str, cwd=None) -> tuple[str, str, list[str]]:
    """run_cli is the CLI's outcome (`exit=N torch=B`, or `crashed` where it ended with a
    traceback), its stderr and the lines it printed before the outcome."""
    done = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)
    lines = done.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("exit="):
        return "crashed", done.stderr, lines
    return lines[-1], done.stderr, lines[:-1]


def committed_run(root):
    """A run directory with one committed checkpoint whose file is not one torch can read."""
    root.mkdir(parents=True)
    (root / "run.yaml").write_text(TINY.read_text())
    pending = store.begin(root / "checkpoints", 10)
    with pending.open("state.pt") as f:
        f.write(b"not a torch file")
    pending.commit("vanilla", 1, {"step": 10})
    return root


@pytest.mark.parametrize("args, message", [
    (["train", "--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["train", "--config", str(TINY), "--set", "train.lr=abc"], "train.lr"),
    (["ckpt", "ls", "nope"], "run directory 'nope' does not exist"),
    (["ckpt", "verify", "nope"], "run directory 'nope' does not exist"),
    (["ckpt", "export", "nope", "--out", "m.pt"], "run directory 'nope' does not exist"),
    (["ckpt", "convert", "nope", "--to", "torch", "s.pt"], "run directory 'nope' does not exist"),
    (["ckpt", "verify", "run", "--step", "7"], "has no checkpoint step 7 (steps: 10)"),
    (["ckpt", "export", "run", "--step", "7", "--out", "m.pt"], "has no checkpoint step 7"),
    (["ckpt", "convert", "run", "--step", "7", "--to", "dcp", "d"], "has no checkpoint step 7"),
    (["ckpt", "convert", "run", "--to", "onnx", "m.onnx"], "--to 'onnx': expected torch or dcp"),
    (["ckpt", "convert", "run", "--to", "torch", "run/run.yaml"], "would replace run.yaml"),
    (["ckpt", "convert", "run", "--to", "torch", "run/checkpoints/step-10/extra.pt"],
     "is inside the run's checkpoints folder"),
    (["ckpt", "convert", "run", "--to", "dcp", "run/checkpoints/step-500"],
     "is inside the run's checkpoints folder"),
    (["ckpt", "convert", "run", "--to", "dcp", "link-to-checkpoints/step-500"],
     "is inside the run's checkpoints folder"),
    (["ckpt", "export", "run", "--out", "run/run.yaml"], "would replace run.yaml"),
    # an unset variable: each said '.' (or the current folder's path), never typed
    (["ckpt", "export", "run", "--out", ""], "--out is empty; name the file to write, e.g. "
     "--out model.pt"),
    (["ckpt", "convert", "run", "--to", "dcp", ""], "OUT is empty; name the file (--to torch) "
     "or folder (--to dcp) to create, e.g. state.pt"),
    (["plot", "run", "--out", ""], "--out is empty; name the image to write, e.g. --out run.png"),
    (["ckpt", "export", "run", "--out", "m.pt", "--format", "onnx"], "--format 'onnx'"),
    (["launch", "--config", str(TINY), "--set", "checkpoint.mode=nonsense"], "checkpoint.mode"),
    (["data", "prepare", "nope", "out.parquet"], "source folder 'nope' does not exist"),
    # an unset variable: both said "'.' is a folder", naming what was never typed
    (["data", "prepare", "run", ""], "OUT is empty; give the parquet file to write, e.g. "
     "corpus.parquet"),
    (["sweep", "launch", "", "--dry-run"], "SWEEP.yaml is empty; give the sweep's YAML file, "
     "e.g. launch/sweeps/tiny-lr.yaml"),
    (["train", "--config", str(TINY), "--run-dir", ""], "--run-dir is empty"),
    (["train", "--config", str(TINY), "--run-dir", "run/checkpoints/step-10"],
     "run/checkpoints/step-10 is inside the run directory"),
    (["train", "--config", str(TINY), "--run-dir", ".", "--nproc", "2"],
     ". holds other runs (run); give the run a folder of its own"),
    (["train", "--config", str(TINY), "--set", "run.storage=run/checkpoints"],
     "is inside the run directory"),
    (["train", "--config", str(TINY), "--run-dir", "link-to-checkpoints/new"],
     "is inside the run directory"),  # through a symbolic link too
    (["bench", "train", "--config", str(TINY), "--set", "train.nope=1"], "unknown key"),
    (["train", "--config", str(TINY), "--set", "data.path=no.parquet"],
     "data file 'no.parquet' does not exist"),
    (["train", "--config", str(TINY), "--set", "data.path=run", "--nproc", "2"],
     "data file 'run' is a folder"),
    (["train", "--config", str(TINY), "--set", "data.path=run/run.yaml"],
     "not a readable parquet file"),
    (["train", "--config", str(TINY), "--run-dir", "run/run.yaml"],
     "run directory 'run/run.yaml' is a file, not a folder"),  # was 'File exists', exit 1
    (["train", "--config", str(TINY), "-c", "b.yaml"],  # was b.yaml alone, silently
     f"--config given 2 times ({TINY}, b.yaml): a run reads one experiment YAML; merge them "
     "into one file, or override its keys with --set KEY=VALUE"),
    (["launch", "--config", "a.yaml", "--config", "b.yaml", "--dry-run"],
     "--config given 2 times (a.yaml, b.yaml)"),
    (["train", "--config", ""],  # an unset variable: it said "config file '.' is a folder"
     "--config is empty; name the experiment YAML, e.g. --config launch/experiments/tiny.yaml"),
    (["launch", "--config", " ", "--dry-run"], "--config is empty"),
    # the benches and sweep launch ran b.yaml alone, silently, as train and launch did
    *[(args + ["-c", "a.yaml", "--config", "b.yaml"], "--config given 2 times (a.yaml, b.yaml)")
      for args in (["bench", "train"], ["bench", "memory", "--dir", "b"],
                   ["bench", "restart", "--dir", "b"], ["bench", "compile", "--dir", "b"],
                   ["bench", "gpu-check", "--out", "g"], ["sweep", "launch", "s.yaml"])],
    (["bench", "train", "--config", ""], "--config is empty"),
    (["sweep", "launch", "s.yaml", "--config", "", "--dry-run"], "--config is empty"),
    # an unset variable was the current folder: `cancel "$RUN"` in a run cancelled that run
    (["cancel", ""], "the run directory is empty; name the run's folder, e.g. pyrecover "
     "cancel runs/NAME"),
    (["launch", "--cluster", "", "--dry-run"],  # it said "cluster profile '.' is a folder"
     "--cluster is empty; name a cluster profile YAML, e.g. --cluster "
     "launch/clusters/local.yaml, or leave it out"),
    (["bench", "restart", "--dir", "b", "--cluster", ""],  # it said '.'
     "--cluster is empty; name a cluster profile YAML, e.g. --cluster "
     "launch/clusters/local.yaml, or leave it out"),
    # the shorthand won silently, even over a --set after it
    (["launch", "--mode", "dcp", "--set", "checkpoint.mode=memory", "--dry-run"],
     "--mode dcp and --set checkpoint.mode=memory disagree: give checkpoint.mode once"),
    (["launch", "--set", "run.exp_name=a", "--exp-name", "b", "--dry-run"],
     "--exp-name b and --set run.exp_name=a disagree"),
    (["demo", "--workdir", ""], "--workdir is empty"),  # was the current folder
    (["demo", "--workdir", "run/run.yaml"], "--workdir run/run.yaml is a file, not a folder"),
    (["demo", "--workdir", "/proc/pyrecover-demo"],  # was exit 1, after building a corpus
     "--workdir /proc/pyrecover-demo cannot be written (No such file or directory); give a "
     "folder this user can write, e.g. --workdir runs"),
    (["launch", "--init-cluster", ""], "--init-cluster is empty"),
    (["launch", "--init-cluster", "run"], "is a folder; --init-cluster writes a file"),
    (["ckpt", "export", "run", "--out", "m.safetensors", "--format", "torch"],
     "names a safetensors file, but --format torch writes a torch pickle"),
])
def test_a_mistake_is_one_line_exit_2_before_torch_is_imported(tmp_path, args, message):
    committed_run(tmp_path / "run")
    (tmp_path / "link-to-checkpoints").symlink_to(tmp_path / "run" / "checkpoints")
    outcome, stderr, _ = run_cli(*args, cwd=tmp_path)
    assert outcome == "exit=2 torch=False", stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], stderr


@pytest.mark.parametrize("flags", [[], ["--json"], ["--clear-bad-nodes"]])
def test_status_of_an_empty_run_directory_is_refused_not_the_run_in_the_current_folder(
        tmp_path, flags):
    """`pyrecover status "$RUN"`, RUN unset, showed (or cleared the bad nodes of) the run it
    was typed in, as `cancel ""` cancelled it."""
    outcome, stderr, printed = run_cli("status", "", *flags, cwd=committed_run(tmp_path / "r"))
    assert (outcome, printed) == ("exit=2 torch=False", []), stderr
    assert stderr.strip().splitlines() == ["error: the run directory is empty; name the run's "
                                           "folder, e.g. pyrecover status runs/NAME"]


@pytest.mark.parametrize("args, kind, example", [
    (["ckpt", "ls", ""], "run", "ckpt ls runs/NAME"),
    (["ckpt", "verify", ""], "run", "ckpt verify runs/NAME"),
    (["ckpt", "export", "", "--out", "m.pt"], "run", "ckpt export runs/NAME"),
    (["ckpt", "convert", "", "--to", "torch", "m.pt"], "run", "ckpt convert runs/NAME"),
    (["plot", ""], "run", "plot runs/NAME"),
    (["sweep", "status", ""], "sweep", "sweep status runs/NAME"),
    (["sweep", "values", ""], "trial", "sweep values runs/NAME/trial-0"),
])
def test_an_empty_run_or_sweep_directory_is_refused_not_the_current_folder(
        tmp_path, args, kind, example):
    """`ckpt ls "$RUN"`, RUN unset, listed (and `plot` drew) the run it was typed in;
    `sweep status ""` said that '.' is not a sweep directory, naming what was never typed."""
    outcome, stderr, printed = run_cli(*args, cwd=committed_run(tmp_path / "r"))
    assert (outcome, printed) == ("exit=2 torch=False", []), stderr
    assert stderr.strip().splitlines() == [f"error: the {kind} directory is empty; name the "
                                           f"{kind}'s folder, e.g. pyrecover {example}"]


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_a_data_mistake_on_an_existing_run_is_recorded_as_its_error_before_torch(tmp_path, nproc):
    """The job script and `status` read a start's error from the run's events; the trainer
    and `train --nproc` (before it spawns) record it the same way."""
    from pyrecover.rundir import RunDir, read_jsonl

    run = RunDir(committed_run(tmp_path / "run"))
    outcome, stderr, _ = run_cli("train", "--config", str(TINY), "--run-dir", str(run.root),
                                 "--nproc", nproc, "--set", "data.path=no.parquet",
                                 cwd=tmp_path)
    assert outcome == "exit=2 torch=False", stderr
    errors = [e for e in read_jsonl(run.events) if e["event"] == "error"]
    assert len(errors) == 1 and "no.parquet" in errors[0]["error"], errors


ATTEMPT = {"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "2"}


@pytest.mark.parametrize("in_job", [None, "1"])
def test_node_0s_other_ranks_exit_only_once_rank_0_recorded_this_attempts_error(
        tmp_path, monkeypatch, in_job):
    """Exiting 2 first would get rank 0 ended by srun before it records why, and the job
    script would requeue a config error as a crash. Records of other attempts do not count."""
    import threading

    from pyrecover.experiment import wait_for_start_error
    from pyrecover.rundir import RunDir, append_jsonl, attempt_fields

    for key, value in {**ATTEMPT, "PYRECOVER_IN_JOB_RESTART": in_job}.items():
        monkeypatch.setenv(key, value) if value else monkeypatch.delenv(key, raising=False)
    run = RunDir(committed_run(tmp_path / "run"))
    mine = attempt_fields(os.environ)
    others = [{**mine, "restart_count": 1}, {**mine, "job_id": "40"},
              {**mine, "in_job_restart": 2}]
    if in_job:
        others.append({k: v for k, v in mine.items() if k != "in_job_restart"})
    for fields in others:  # as written, without this attempt's fields filled in
        append_jsonl(run.events, {"event": "error", "time": 1.0, **fields, "error": "earlier"})
    run.event("start", step=0)  # this attempt's, not an error
    assert not wait_for_start_error(run, timeout_s=0.2)

    written = threading.Event()

    def rank_0():
        written.set()  # before: the waiter may see the record before this thread goes on
        run.event("error", rank=0, error="DataError: data file 'x' does not exist")

    writer = threading.Timer(0.3, rank_0)
    writer.start()
    try:
        assert wait_for_start_error(run, timeout_s=120)
        assert written.is_set()
    finally:
        writer.join()


WAIT_THEN_STOP = """
import os, signal, sys, threading
from pathlib import Path
from pyrecover import experiment, preempt
from pyrecover.rundir import RunDir
preempt.catch_early()
run = RunDir(Path(sys.argv[1]))
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
print("recorded" if experiment.wait_for_start_error(run, timeout_s=3600) else "stopped")
"""


def test_a_waiting_rank_stops_waiting_when_slurm_ends_the_step(tmp_path):
    """Rank 0 exits 2 whether or not it could record (a live run holds the lock): SLURM then
    SIGTERMs the others, which must go at once, not after the wait's bound."""
    run = committed_run(tmp_path / "run")
    done = subprocess.run([sys.executable, "-c", WAIT_THEN_STOP, str(run)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **ATTEMPT})
    assert done.stdout.strip() == "stopped", done.stderr


def test_outside_slurm_and_outside_a_run_other_ranks_do_not_wait(tmp_path, monkeypatch):
    from pyrecover.experiment import wait_for_start_error
    from pyrecover.rundir import RunDir

    for key in ("SLURM_JOB_ID", "PYRECOVER_IN_JOB_RESTART"):
        monkeypatch.delenv(key, raising=False)
    assert not wait_for_start_error(RunDir(committed_run(tmp_path / "run")), timeout_s=120)
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    assert not wait_for_start_error(RunDir(tmp_path / "new"), timeout_s=120)


def test_ckpt_ls_fast_reads_manifests_only_and_the_full_listing_opens_the_checkpoint(tmp_path):
    run = committed_run(tmp_path / "run")
    outcome, stderr, lines = run_cli("ckpt", "ls", str(run), "--fast")
    assert outcome == "exit=0 torch=False", stderr
    assert lines[-1].endswith("  sizes ok"), lines  # not "ok": no checksum was read
    empty = tmp_path / "empty"
    (empty / "checkpoints").mkdir(parents=True)
    assert run_cli("ckpt", "ls", str(empty))[0] == "exit=0 torch=False"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("print('hi')\n")
    assert run_cli("data", "prepare", str(tmp_path / "src"), str(tmp_path / "c.parquet")
                   )[0] == "exit=0 torch=False"
    assert (tmp_path / "c.parquet").is_file()
    # Without --fast, a checkpoint whose files verify is opened as a restore would open it.
    outcome, stderr, rows = run_cli("ckpt", "ls", str(run), "--json")
    assert outcome == "exit=0 torch=True", stderr
    assert len(rows) == 1 and '"valid": false' in rows[0] and "cannot be read" in rows[0], rows


@pytest.mark.parametrize("module, name", USER_ERRORS + FAULTS)
def test_every_error_the_cli_says_in_one_line_names_a_class_where_it_is_defined(module, name):
    # The CLI looks each up only once its module is imported: a name that no longer matches
    # would turn that mistake into a traceback.
    __import__(module)
    cls = getattr(sys.modules[module], name)
    assert issubclass(cls, Exception) and cls.__module__ == module


def test_version_names_pyrecover_torch_and_python_without_importing_torch():
    from importlib import metadata

    import pyrecover

    outcome, stderr, printed = run_cli("--version")
    assert outcome == "exit=0 torch=False", stderr
    python = ".".join(map(str, sys.version_info[:3]))
    assert printed == [f"pyrecover {pyrecover.__version__} (torch {metadata.version('torch')}, "
                       f"Python {python})"]
