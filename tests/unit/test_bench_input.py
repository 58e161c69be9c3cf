"""What the benches do with what a user may type: a mode or kind named twice, a gpu-check
argument out of range, a folder that is a file or does not exist yet, a Python without
pyrecover's dependencies."""

from __future__ import annotations

import json
import subprocess
import venv
from pathlib import Path

import pytest
from helpers import TINY, pyrecover
from typer.testing import CliRunner

from pyrecover.bench import train as bench_train
from pyrecover.cli import app

REPO = Path(__file__).resolve().parents[2]


def test_bench_ckpt_measures_a_mode_named_twice_once_per_repeat(tmp_path):
    """`--mode vanilla --mode vanilla --repeat 1` measured vanilla twice into one row: a
    min-max of two runs under "median of 1"."""
    done = pyrecover("bench", "ckpt", "--dir", str(tmp_path / "b"), "--size-gb", "0.002",
                     "--repeat", "1", "--mode", "vanilla", "--mode", "vanilla", "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("repeat 1/1: vanilla") == 1, done.stderr
    rows = [r for r in json.loads(done.stdout)["rows"] if r["method"] == "vanilla"]
    assert rows and all(r["min_s"] == r["median_s"] == r["max_s"] for r in rows), rows


def test_bench_train_shows_a_mode_named_twice_as_one_row(tmp_path, monkeypatch, corpus):
    """It was two identical rows, each the median of both modes' runs."""
    runs = []
    monkeypatch.setattr(bench_train, "_train_once", lambda c, o, run_dir: runs.append(run_dir))
    monkeypatch.setattr(bench_train, "_throughput", lambda *a: {
        "tokens_per_s": 100.0, "saves": 1, "blocked_s": 0.0, "blocked_share": 0.0,
        "mfu": None, "checkpoint_bytes": 1})
    report = bench_train.bench_train(TINY, ["train.device=cpu", f"data.path={corpus}"], 1, 1, 0,
                                     repeat=1,
                                     modes=("vanilla", "vanilla"), workdir=tmp_path)
    assert [r["mode"] for r in report["rows"]] == ["none", "vanilla"]
    assert len(runs) == 2  # none and vanilla, once each


def test_bench_train_refuses_a_train_profile_that_would_trace_its_measured_steps(tmp_path):
    """`--set train.profile=1-2` traced the warm-up and the measured steps of every mode, so
    tokens/s counted the profiler's cost, and the traces went with the bench's runs."""
    result = CliRunner().invoke(app, ["bench", "train", "--config", str(TINY), "--set",
                                      "train.profile=1-2", "--steps", "2", "--warmup", "1"])
    assert result.exit_code == 2, result.output
    assert ("error: train.profile=1-2 would trace the steps the bench times, and its traces "
            "are removed with the bench's runs; leave it out (--set train.profile=) and use "
            "--profile N (steps after the measured ones, traces in --profile-dir)"
            ) in result.output


@pytest.mark.parametrize("command", [["memory", "--size-gb", "0.001"], ["compile"]])
def test_the_other_benches_refuse_a_train_profile_too(tmp_path, command):
    """bench memory's throughput runs and bench compile's first steps ran under the profiler,
    timed with its cost."""
    done = pyrecover("bench", *command, "--dir", str(tmp_path / "b"), "--config", str(TINY),
                     "--set", "train.profile=1-2", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: train.profile=1-2 would trace the steps the bench times, and its traces are "
        "removed with the bench's runs; leave it out (--set train.profile=)")
    assert list(tmp_path.iterdir()) == []


def test_bench_restart_interrupts_each_kind_named_twice_repeat_times(tmp_path, monkeypatch):
    from pyrecover.bench import restart_local

    seen = {}

    def fake(directory, config, overrides, nproc, kinds, *args, **kwargs):
        seen["kinds"] = kinds
        raise restart_local.BenchError("stop here")

    monkeypatch.setattr(restart_local, "bench_restart_local", fake)
    result = CliRunner().invoke(app, ["bench", "restart", "--local", "--dir", str(tmp_path),
                                      "--interrupt", "signal", "--interrupt", "signal"])
    assert result.exit_code == 2, result.output
    assert seen["kinds"] == ("signal",)


@pytest.mark.parametrize("args, line", [
    (["--size-gb", "0"], "error: --size-gb must be > 0 (got 0)"),
    (["--steps", "0"], "error: --steps must be >= 1 (got 0)"),
    (["--interval", "0"], "error: --interval must be >= 1 (got 0)"),
    (["--warmup", "-1"], "error: --warmup must be >= 0 (got -1)"),
    (["--cpu-repeat", "0"], "error: --cpu-repeat must be >= 1 (got 0)"),
    (["--cpu-state-gb", "0"], "error: --cpu-state-gb must be in (0, 64] (got 0)"),
    (["--cpu-state-gb", "65"], "error: --cpu-state-gb must be in (0, 64] (got 65)"),
])
def test_gpu_check_refuses_a_number_out_of_range_before_any_step(tmp_path, corpus, args,
                                                                 line):
    """Each used to run the check, fail its own step and end with exit 1 (kept small here,
    with --only ckpt at 1 MB, in case it runs again)."""
    out = tmp_path / "check"
    done = pyrecover("bench", "gpu-check", "--allow-cpu", "--no-tests", "--out", str(out),
                     "--config", str(TINY), "--set", f"data.path={corpus}", "--only", "ckpt",
                     "--size-gb", "0.001", *args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == line
    assert not out.exists()


@pytest.mark.parametrize("command", [["gpu-check", "--allow-cpu", "--no-tests", "--out"],
                                     ["ckpt", "--size-gb", "0.001", "--dir"]])
def test_a_file_given_as_the_folder_is_one_line_saying_so(tmp_path, command):
    taken = tmp_path / "a-file"
    taken.write_text("")
    extra = ["--config", str(TINY)] if command[0] == "gpu-check" else []
    done = pyrecover("bench", *command, str(taken), *extra)
    assert done.returncode == 2, done.stderr
    flag = command[-1]
    assert done.stderr.strip() == (f"error: {flag} {taken}: cannot be used (a file, not a "
                                   "folder); give a writable folder")


@pytest.mark.parametrize("command", [
    ["ckpt", "--size-gb", "0.001", "--dir"], ["memory", "--size-gb", "0.001", "--dir"],
    ["compile", "--dir"], ["restart", "--local", "--dir"],
    ["gpu-check", "--allow-cpu", "--no-tests", "--out"], ["train", "--profile-dir"]])
def test_an_empty_folder_is_refused_not_taken_for_the_current_one(tmp_path, command):
    """`--dir "$SCRATCH"` with the variable unset measured (and wrote into) the folder the
    command ran in: Path('') is '.'."""
    done = pyrecover("bench", *command, "", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    flag = command[-1]
    assert done.stderr.strip() == (f"error: {flag} is empty; give a folder, e.g. {flag} "
                                   "/scratch/$USER/bench")
    assert list(tmp_path.iterdir()) == []


def test_bench_ckpt_refuses_a_state_larger_than_this_machines_memory_holds(tmp_path,
                                                                          monkeypatch):
    """The README's `--size-gb 4` on a 24 GB machine: the kernel's OOM killer ended the bench
    without a word, and its pyrecover-bench-* folder of GBs stayed on the storage. With every
    mode it holds about 8.5 times the state (measured at 0.1, 0.5 and 1 GB)."""
    from pyrecover.bench import ckpt

    monkeypatch.setattr(ckpt, "available_memory", lambda: 24_000_000_000)
    result = CliRunner().invoke(app, ["bench", "ckpt", "--dir", str(tmp_path / "b"),
                                      "--size-gb", "4"])
    assert result.exit_code == 2, result.output
    assert ("error: 24.0 GB of memory available; --size-gb 4 with vanilla, dcp-sync, "
            "dcp-async, memory needs about 34.0 GB (fewer --mode, or a smaller --size-gb)"
            ) in result.output
    assert list(tmp_path.iterdir()) == []


def test_bench_compile_makes_its_folder_and_removes_it_again(tmp_path, monkeypatch, corpus):
    """It refused a --dir that did not exist yet, where every other bench makes it."""
    from pyrecover.bench import compile as bench_compile

    def fake(work, *args):
        assert work.parent == tmp_path / "new" / "bench"
        raise bench_compile.BenchError("stop here")

    monkeypatch.setattr(bench_compile, "_attempt", fake)
    with pytest.raises(bench_compile.BenchError, match="stop here"):
        bench_compile.bench_compile(tmp_path / "new" / "bench", TINY, [f"data.path={corpus}"], 1)
    assert list(tmp_path.iterdir()) == []


def test_a_dir_written_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch, corpus):
    """`--dir=~/bench` (bash expands no tilde after `--dir=`) measured, and for restart left
    its run in, a folder named `~` in the working directory, on whatever storage that is."""
    from pyrecover.bench import compile as bench_compile

    seen = []

    def fake(work, *args):
        seen.append(work.parent)
        raise bench_compile.BenchError("stop here")

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench_compile, "_attempt", fake)
    result = CliRunner().invoke(app, ["bench", "compile", "--dir=~/bench", "--config",
                                      str(TINY), "--set", f"data.path={corpus}"])
    assert result.exit_code == 2, result.output
    assert seen == [tmp_path / "home" / "bench"]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["train"], ["compile", "--dir", "b"]])
def test_a_bench_without_its_corpus_says_so_before_it_runs_anything(tmp_path, command):
    """On a fresh machine `pyrecover bench train` (the demo's corpus, not built yet) said
    that it was training, then that the run failed; bench compile started three attempts."""
    done = pyrecover("bench", *command, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "error: data file 'runs/stdlib.parquet' does not exist; build one with `pyrecover data "
        "prepare SRC_DIR OUT.parquet` (`pyrecover demo` builds this default one)")
    assert list(tmp_path.iterdir()) == []


def test_a_python_without_the_dependencies_is_told_what_to_install(tmp_path):
    """`make gpu-check` runs the source tree where pip could not install the package: a
    machine's own Python without typer ended in a traceback."""
    venv.create(tmp_path / "bare", with_pip=False)
    python = tmp_path / "bare" / "bin" / "python"
    done = subprocess.run([str(python), "-m", "pyrecover", "bench", "gpu-check"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: No module named "), lines
    assert f"{python} -m pip install -e ." in lines[0]
