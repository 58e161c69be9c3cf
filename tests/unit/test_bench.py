"""`pyrecover bench`: runs at a tiny size and reports figures whose ratios add up."""

from __future__ import annotations

import json

import pytest
from helpers import TINY, pyrecover

from pyrecover.bench import ckpt as bench


def by_key(rows: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["method"], r["metric"]): r for r in rows}


def test_bench_ckpt_json_has_every_figure_positive_and_ratios_equal_figure_over_baseline(
        tmp_path):
    done = pyrecover("bench", "ckpt", "--dir", str(tmp_path / "new" / "folder"), "--size-gb",
                     "0.008", "--repeat", "1", "--json")
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []  # the folders it made, removed with its files
    report = json.loads(done.stdout)
    rows = by_key(report["rows"])
    expected = {("raw", m) for m in ("save", "load_cold", "load_warm", "blocked")}
    if report["raw_write"].startswith("O_DIRECT"):  # then also timed through the page cache,
        expected.add(("raw-buffered", "save"))  # and the O_DIRECT file's first read
        expected.add(("raw-direct", "load_cold"))
    expected |= {("torch", m) for m in ("save", "load_cold", "load_warm")}
    expected |= {("torch-mmap", m) for m in ("load_cold", "load_warm")}
    expected |= {(mode, m) for mode in bench.MODES for m in bench.METRICS}
    assert set(rows) == expected
    for (method, metric), r in rows.items():
        for key in ("median_s", "min_s", "max_s", "bytes", "gb_per_s", "vs_raw", "vs_torch"):
            assert isinstance(r[key], (int, float)) and r[key] > 0, (method, metric, key)
        assert r["min_s"] <= r["median_s"] <= r["max_s"]
        torch_ref = metric if method == "torch-mmap" else bench.REFERENCE[metric]
        raw_ref = bench.RAW_REFERENCE[metric]  # a save's blocked time: the copy in memory
        assert r["vs_raw"] == pytest.approx(r["median_s"] / rows[("raw", raw_ref)]["median_s"])
        assert r["vs_torch"] == pytest.approx(
            r["median_s"] / rows[("torch", torch_ref)]["median_s"])
        assert r["gb_per_s"] == pytest.approx(r["bytes"] / r["median_s"] / 1e9)
    assert report["world_size"] == 1 and report["state_bytes"] > 4e6
    assert report["cache_drop"].startswith("posix_fadvise")
    assert report["cached_after_drop_max"] is None or report["cached_after_drop_max"] < 0.5
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("pyrecover-bench-")]


def test_bench_train_reports_each_mode_as_a_ratio_to_no_checkpoints(tmp_path, corpus):
    done = pyrecover("bench", "train", "--config", str(TINY), "--set", f"data.path={corpus}",
                     "--steps", "6", "--warmup", "1", "--interval", "2", "--mode", "vanilla",
                     "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {r["mode"]: r for r in report["rows"]}
    assert set(rows) == {"none", "vanilla"}
    assert rows["none"]["saves"] == 0 and rows["vanilla"]["saves"] == 3  # steps 2, 4 and 6
    for r in rows.values():
        assert r["tokens_per_s"] > 0
        assert r["vs_none"] == pytest.approx(r["tokens_per_s"] / rows["none"]["tokens_per_s"])


def test_bench_train_says_when_no_save_falls_in_the_measured_steps(tmp_path, corpus):
    """--interval past the measured steps: every mode saved nothing and read about 1.0 x none,
    a checkpoint that looked free, with nothing said."""
    done = pyrecover("bench", "train", "--config", str(TINY), "--set", f"data.path={corpus}",
                     "--steps", "2", "--warmup", "1", "--interval", "50", "--mode", "vanilla",
                     cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    said = ("--interval 50: no save falls in the measured steps 2-3, so the checkpoint "
            "modes' figures hold none")
    assert said in done.stderr and said in done.stdout
    assert "vanilla" in done.stdout


def test_a_run_that_saves_nothing_in_the_measured_steps_reports_no_blocked_time(tmp_path,
                                                                                corpus):
    """`none` read "saves 0 ... blocked % 0.12": the manager's bookkeeping at every step
    boundary, with nothing to save, was counted as the loop waiting for a save. (The warm-up
    covers the one-time preparation of the save buffers, after the first update.)"""
    done = pyrecover("bench", "train", "--config", str(TINY), "--set", f"data.path={corpus}",
                     "--steps", "4", "--warmup", "2", "--interval", "50", "--mode", "vanilla",
                     "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    rows = {r["mode"]: r for r in json.loads(done.stdout)["rows"]}
    assert {m: (r["saves"], r["blocked_s"], r["blocked_share"]) for m, r in rows.items()} == {
        "none": (0, 0, 0), "vanilla": (0, 0, 0)}


def test_bench_train_logs_as_the_config_does_and_measures_whole_logged_windows(
        tmp_path, corpus):
    """A logged step is where the loop waits for the device, so the bench keeps the config's
    log interval (a run that logged every step would measure a wait the user's run does not
    make) and rounds the warm-up and the measured steps up to multiples of it."""
    done = pyrecover("bench", "train", "--config", str(TINY), "--set", f"data.path={corpus}",
                     "--set", "train.log_interval=3", "--steps", "4", "--warmup", "1",
                     "--interval", "2", "--mode", "vanilla", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "train.log_interval is 3: 3 warm-up and 6 measured steps" in done.stderr
    report = json.loads(done.stdout)
    assert (report["warmup"], report["steps"], report["log_interval"]) == (3, 6, 3)
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["vanilla"]["saves"] == 3  # steps 4, 6 and 8, after the warm-up's 3
    assert rows["none"]["tokens_per_s"] > 0


def test_bench_train_profiles_steps_after_the_measured_ones_and_keeps_their_traces(
        tmp_path, corpus):
    done = pyrecover("bench", "train", "--config", str(TINY), "--set", f"data.path={corpus}",
                     "--steps", "6", "--warmup", "1", "--interval", "2", "--mode", "vanilla",
                     "--profile", "2", "--profile-dir", "prof", "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["vanilla"]["saves"] == 3  # steps 2, 4 and 6: not the profiled 8
    for mode in ("none", "vanilla"):
        profile = rows[mode]["profile"]
        assert (profile["first"], profile["last"], profile["steps"]) == (8, 9, 2)
        assert profile["wall_s"] > 0
        assert profile["trace"] == str(tmp_path / "prof" / mode / "steps-8-9-rank-0.trace.json.gz")
        assert (tmp_path / "prof" / mode / "steps-8-9-rank-0.txt").is_file()
    from pyrecover.bench.train import format_train

    assert "torch.profiler, 2 steps after the measured ones" in format_train(report)


def test_a_logged_row_counts_for_every_step_of_its_window(tmp_path):
    from pyrecover.bench.train import _throughput
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    for step, step_time, tok_s in ((4, 9.0, 1.0), (8, 0.1, 100.0), (12, 0.3, 50.0),
                                   (14, 5.0, 2.0)):  # 14: a profiled step after the end
        run.metric(step=step, step_time=step_time, tokens_per_s=tok_s,
                   checkpoint_stall_total=step / 100)
    got = _throughput(tmp_path / "run", warmup=4, end=12)
    # 4 steps at 0.1 s (40 tokens) and 4 at 0.3 s (60 tokens): 100 tokens in 1.6 s.
    assert got["tokens_per_s"] == pytest.approx(100 / 1.6)
    assert got["blocked_s"] == pytest.approx(0.08) and got["blocked_share"] == pytest.approx(
        0.05)


def test_a_mode_that_fails_is_a_row_saying_why_and_the_other_modes_are_still_measured(
        tmp_path, corpus, monkeypatch):
    """On a first GPU run, one broken mode used to abort the whole bench and hide the figures
    of every other mode. Here vanilla's run is made to fail (the only stand-in: the trainer
    itself runs for real for the other modes)."""
    import os
    import signal

    from pyrecover.bench import train as bench_train

    real = bench_train._train_once
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # the bench sets its own

    def vanilla_fails(config, overrides, run_dir):
        if "checkpoint.mode=vanilla" in overrides:
            raise bench_train.BenchError("the training run failed: OSError: disk full")
        return real(config, overrides, run_dir)

    monkeypatch.setattr(bench_train, "_train_once", vanilla_fails)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1,
                                                  signal.SIGUSR2)}
    report = bench_train.bench_train(TINY, [f"data.path={corpus}",
                                            f"run.storage={tmp_path}"], 2, 3, 1,
                                     modes=("vanilla", "dcp-sync"), workdir=tmp_path)
    rows = {r["mode"]: r for r in report["rows"]}
    assert rows["vanilla"] == {"mode": "vanilla",
                               "error": "the training run failed: OSError: disk full"}
    assert rows["dcp-sync"]["tokens_per_s"] > 0 and rows["dcp-sync"]["saves"] >= 1
    assert "vanilla    FAILED: the training run failed" in bench_train.format_train(report)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ  # the bench's own is gone again
    # The trainer's stop-flag handlers are gone too: a SIGTERM stops the bench again.
    assert {s: signal.getsignal(s) for s in handlers} == handlers


def test_a_sigterm_during_a_later_mode_stops_the_whole_bench_train(tmp_path, corpus):
    """gpu-check's step timeout (and a job's end) sends SIGTERM. The trainer takes it as a
    stop and saves; the bench must then stop too (exit 143, one line, its work folder gone),
    not report that mode as failed and go on measuring the others."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from pyrecover.rundir import read_jsonl

    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    # TMPDIR: the bench's work folder. Each step takes 50 ms or more (the same model, made
    # slow), so a run lasts 5 s or more and the signal lands inside vanilla's.
    env.update(WANDB_MODE="disabled", TMPDIR=str(tmp_path), PYRECOVER_STEP_DELAY="0.05")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pyrecover", "bench", "train", "--config", str(TINY), "--set",
         f"data.path={corpus}", "--mode", "vanilla", "--steps", "100", "--warmup", "0",
         "--interval", "1000"], env=env, start_new_session=True, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < deadline:
            # `none` runs first; vanilla's run, once it logs, has 99 of its steps to go.
            if any(read_jsonl(m) for m in tmp_path.glob("pyrecover-bench-train-*/vanilla-0/"
                                                          "metrics.jsonl")):
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == (
        "bench train: stopped by a signal (SIGTERM); nothing measured"), err
    assert out == "" and not list(tmp_path.glob("pyrecover-bench-train-*"))


def test_bench_ckpt_counts_an_async_save_s_commit_in_the_loop_s_blocked_time(tmp_path,
                                                                             monkeypatch):
    """The commit of a dcp-async save runs in the step boundary that finds its write done, and
    blocks the loop there as in training; bench ckpt dropped those calls' seconds, so a slow
    commit (fsyncs on a shared file system) never reached its `blocked` figure. The commit is
    a stand-in that takes 0.2 s more."""
    import time

    from pyrecover.bench.state import build_state
    from pyrecover.checkpoint import store

    real = store.Pending.commit

    def slow(self, *args, **kwargs):
        time.sleep(0.2)  # the time a slow file system takes; nothing is waited for
        return real(self, *args, **kwargs)

    monkeypatch.setattr(store.Pending, "commit", slow)
    saver = bench._ModeBench("dcp-async", tmp_path, build_state(200_000, seed=0),
                             build_state(200_000, seed=1))
    _, blocked, folder = saver.save()
    assert blocked >= 0.2 and store.verify(folder).step == 2


def test_bench_ckpt_charges_the_loop_one_step_boundary_for_an_async_save_s_commit(
        tmp_path, monkeypatch):
    """However long the background write takes, the loop meets it at two step boundaries: the
    one that starts the save and the one that commits it. bench ckpt polled `at_step` every
    0.5 ms until the commit and counted every poll as blocked time, a step boundary per poll
    that no training loop has. The write is a stand-in that takes 0.3 s more."""
    import time

    from pyrecover.bench.state import build_state
    from pyrecover.checkpoint import dcp, store

    real = dcp.DcpMode._save

    def slow(self, *args, **kwargs):
        time.sleep(0.3)  # a slow file system; in the save's own thread
        return real(self, *args, **kwargs)

    monkeypatch.setattr(dcp.DcpMode, "_save", slow)
    saver = bench._ModeBench("dcp-async", tmp_path, build_state(200_000, seed=0),
                             build_state(200_000, seed=1))
    calls = []
    at_step = saver.saver.at_step
    monkeypatch.setattr(saver.saver, "at_step", lambda *a, **k: calls.append(a) or at_step(*a, **k))
    total, _, folder = saver.save()
    assert total >= 0.3 and store.verify(folder).step == 2
    assert calls == [(2,), (3,)]


@pytest.mark.parametrize("which", ["train", "memory"])
def test_the_none_baseline_snapshots_nothing_with_a_memory_mode_config(which):
    """Only checkpoint.interval was pushed past the end for `none`: with checkpoint.mode
    memory the baseline itself snapshotted every snapshot_interval (default 5)."""
    from pyrecover import config as config_mod
    from pyrecover.bench import memory as bench_memory
    from pyrecover.bench import train as bench_train

    total = 30
    sets = (bench_train.mode_sets("none", 2, total) if which == "train"
            else bench_memory.mode_overrides("none", 2, total))
    cfg = config_mod.load(TINY, ["checkpoint.mode=memory", *sets])
    assert cfg.checkpoint.snapshot_interval > total  # no snapshot in the run


@pytest.mark.parametrize("command", [["ckpt", "--size-gb", "0.001"], ["memory"],
                                     ["restart", "--local"]])
def test_a_bench_folder_that_cannot_be_made_is_one_line_not_a_traceback(tmp_path, command,
                                                                         corpus):
    taken = tmp_path / "a-file"
    taken.write_text("")
    extra = ["--config", str(TINY), "--set", f"data.path={corpus}"] if command[0] != "ckpt" \
        else []
    done = pyrecover("bench", *command, "--dir", str(taken / "sub"), *extra)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().count("\n") == 0 and "cannot be used" in done.stderr, \
        done.stderr


@pytest.mark.parametrize("args, line", [
    (["train", "--interval", "0"], "error: --interval must be >= 1 (got 0)"),
    (["train", "--repeat", "0", "--warmup", "-1"], "error: --repeat must be >= 1 (got 0)"),
    (["train", "--profile", "-1"], "error: --profile must be >= 0 (got -1)"),
    (["ckpt", "--size-gb", "0"], "error: --size-gb must be > 0 (got 0)"),
    (["ckpt", "--repeat", "0"], "error: --repeat must be >= 1 (got 0)"),
    (["compile", "--repeat", "0"], "error: --repeat must be >= 1 (got 0)"),
])
def test_a_number_out_of_range_is_one_line_naming_that_option_alone(tmp_path, args, line):
    """Each bench names the one option at fault and its value, not every limit it checks."""
    extra = [] if args[0] == "train" else ["--dir", str(tmp_path / "bench")]
    done = pyrecover("bench", *args, *extra, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == line
    assert not (tmp_path / "bench").exists()
