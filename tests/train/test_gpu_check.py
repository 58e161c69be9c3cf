"""`pyrecover bench gpu-check` on the CPU: the check itself runs every step and reports every
bound, so a GPU machine's only job is to supply the figures."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import TINY, pyrecover


def test_gpu_check_runs_every_benchmark_and_reports_each_bound(tmp_path, corpus):
    out = tmp_path / "check"
    done = pyrecover("bench", "gpu-check", "--out", str(out), "--config", str(TINY),
                     "--set", f"data.path={corpus}", "--steps", "3", "--warmup", "1",
                     "--interval", "2", "--size-gb", "0.01", "--no-tests", "--allow-cpu",
                     "--cpu-repeat", "1", "--cpu-state-gb", "0.01", "--cpu-steps", "4",
                     timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert {n: s["returncode"] for n, s in report["steps"].items()} == {
        "train": 0, "memory-every-step": 0, "ckpt": 0, "memory-cpu": 0, "compile": 0,
        "restart-cpu": 0, "restart-cpu-4": 0, "restart-cpu-1gb": 0, "restart-gpu": 0}
    assert len(report["bounds"]) == 11
    # The loop's blocked time per dcp-async save, against vanilla's per save, in training.
    rows = {r["mode"]: r for r in report["steps"]["train"]["report"]["rows"]}
    per_save = {m: rows[m]["blocked_s"] / rows[m]["saves"] for m in ("dcp-async", "vanilla")}
    ratio = {b["figure"]: b["value"] for b in report["bounds"]}[
        "loop blocked per dcp-async save in training vs vanilla's"]
    assert ratio == per_save["dcp-async"] / per_save["vanilla"]
    assert all(isinstance(b["value"], float) and b["met"] in (True, False)
               for b in report["bounds"]), report["bounds"]
    assert rows["plain"]["vs_plain"] == 1.0 and rows["none"]["vs_plain"] > 0
    compiled = report["steps"]["compile"]["report"]  # the compile cache, measured on restarts
    assert {r["attempt"]: (r["hits"] > 0, r["misses"] > 0) for r in compiled["rows"]} == {
        "first start": (False, True), "restart, run's cache": (True, False),
        "restart, empty cache": (False, True)}
    text = (out / "report.txt").read_text()
    assert "vs the plain compiled loop" in text and (out / "train.log").is_file()
    # Where torch's bytecode came from: without it every restart compiles torch again.
    assert report["bytecode"].startswith(("cached beside", "written beside", "the cache",
                                          "pyrecover's cache", "compiled at every start"))
    assert f"torch's bytecode: {report['bytecode']}" in text
    assert "run compile cache vs empty" in text
    # The ckpt bound's floor on this machine: one copy of the state in memory, no step beside.
    ckpt = {(r["method"], r["metric"]): r for r in report["steps"]["ckpt"]["report"]["rows"]}
    floor = ckpt[("raw", "blocked")]["vs_torch"]
    line = next(x for x in text.splitlines() if "the floor of the ckpt bound" in x)
    assert line.startswith("one copy of that state in memory") and f"{floor:.3f}" in line
    # Memory mode's snapshots on the CPU cores, at world size 2, with the core count.
    memory = {r["mode"]: r for r in report["steps"]["memory-cpu"]["report"]["train"]["rows"]}
    assert memory["memory"]["snapshots"] > 0 and memory["none"]["snapshots"] == 0
    cpu_argv = report["steps"]["memory-cpu"]["argv"]
    assert cpu_argv[cpu_argv.index("--steps") + 1] == "4"  # --cpu-steps
    assert f"--- bench memory (memory-cpu, {report['cpus']} CPUs) ---" in text
    # The restarts: world sizes 2 and 4 on the CPU, and the experiment on the device.
    worlds = {n: report["steps"][n]["report"]["world_size"]
              for n in ("restart-cpu", "restart-cpu-4", "restart-gpu")}
    assert worlds == {"restart-cpu": 2, "restart-cpu-4": 4, "restart-gpu": 1}
    assert "restart after a crash, GPU, world size 1" in text
    assert "--- bench restart --local (restart-cpu-4) ---" in text

    # A check split over calls: one step again keeps the others of the same device.
    again = pyrecover("bench", "gpu-check", "--out", str(out), "--config", str(TINY),
                      "--set", f"data.path={corpus}", "--allow-cpu", "--only", "ckpt",
                      "--size-gb", "0.01")
    assert again.returncode == 0, again.stderr[-3000:]
    merged = json.loads((out / "report.json").read_text())
    assert list(merged["steps"]) == list(report["steps"])
    assert merged["steps"]["compile"] == report["steps"]["compile"]
    assert merged["steps"]["ckpt"] != report["steps"]["ckpt"]  # measured again
    wrong = pyrecover("bench", "gpu-check", "--out", str(out), "--allow-cpu", "--only", "nope")
    assert wrong.returncode == 2 and "no such step" in wrong.stderr, wrong.stderr
    for bad in ("-5", "inf", "nan"):
        refused = pyrecover("bench", "gpu-check", "--out", str(out), "--allow-cpu",
                            "--step-timeout", bad)
        said = f"--step-timeout {bad}" if bad == "-5" else f"'--step-timeout': {bad} is not"
        assert refused.returncode == 2 and said in refused.stderr, (bad, refused.stderr)
    nothing = pyrecover("bench", "gpu-check", "--out", str(out), "--allow-cpu", "--no-tests",
                        "--only", "tests")
    assert nothing.returncode == 2 and "nothing to run" in nothing.stderr, nothing.stderr


def test_gpu_check_without_a_gpu_says_so_in_one_line(tmp_path):
    done = pyrecover("bench", "gpu-check", "--out", str(tmp_path / "check"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()]
    assert "no CUDA GPU" in done.stderr


def test_a_step_past_its_timeout_is_killed_with_its_children_and_reported(tmp_path):
    """A hung step (here one that would sleep ten minutes, with two children: one in its
    process group, one in a session of its own, as the tests' CLIs run) must not take the rest
    of the check with it, nor leave anything running on the GPU: its process group is stopped
    (SIGTERM first, so a bench can stop what it started), whatever it started elsewhere is
    killed, and the step says why."""
    import subprocess
    import sys

    from pyrecover.bench.steps import Step, run_step

    pidfile = tmp_path / "children.pid"
    sleeper = "[sys.executable, '-c', 'import time; time.sleep(600)']"
    script = ("import os, subprocess, sys, time; "
              f"a = subprocess.Popen({sleeper}); "
              f"b = subprocess.Popen({sleeper}, start_new_session=True, "
              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL); "
              f"open({str(pidfile)!r} + '.tmp', 'w').write(f'{{a.pid}} {{b.pid}}'); "
              f"os.replace({str(pidfile)!r} + '.tmp', {str(pidfile)!r}); "
              "time.sleep(600)")
    # 15 s: far longer than starting two sleepers takes, even on a busy machine.
    step = run_step(Step("hung", [sys.executable, "-c", script]), tmp_path, {}, False,
                    timeout_s=15)
    assert step.returncode == -15  # SIGTERM ended it; SIGKILL only after STOP_GRACE_S
    assert "killed after 15s (--step-timeout)" in step.tail
    assert "killed after 15s" in (tmp_path / "hung.log").read_text()
    for child in map(int, pidfile.read_text().split()):
        state = subprocess.run(["ps", "-o", "stat=", "-p", str(child)], capture_output=True,
                               text=True).stdout.strip()
        assert state[:1] in ("", "Z"), (child, state)  # gone, or a zombie ('ZN' if niced)


def test_a_budget_runs_the_steps_it_has_time_for_and_names_the_rest(tmp_path, corpus):
    """--budget (a lease's seconds): a step starts only with a minute of it left, and its time
    limit is what is left; the report names the steps not run and the --only that runs them.
    The clock is the one stand-in: the budget is spent when the second step would start."""
    from pyrecover.bench import gpu_check as check

    ticks = iter([0.0, 0.0])  # the start, then before the first step; then 30 s gone
    report = check.gpu_check(tmp_path, TINY, [f"data.path={corpus}"], 3, 1, 2, 0.01,
                             run_tests=False, allow_cpu=True, only=("ckpt", "train"),
                             budget_s=check.MIN_STEP_S + 20, clock=lambda: next(ticks, 30.0))
    assert list(report["steps"]) == ["ckpt"] and report["steps"]["ckpt"]["returncode"] == 0
    assert report["not_run"] == ["train"]
    assert "not run (--budget spent): train; next time: --only train" in (
        tmp_path / "report.txt").read_text()
    # The next call, its budget spent before its one step: the report keeps ckpt and says it
    # is an earlier call's (a FAILED kept step read beside "not run" as run now).
    ticks = iter([0.0])
    report = check.gpu_check(tmp_path, TINY, [f"data.path={corpus}"], 3, 1, 2, 0.01,
                             run_tests=False, allow_cpu=True, only=("train",),
                             budget_s=check.MIN_STEP_S + 20, clock=lambda: next(ticks, 30.0))
    assert report["kept"] == ["ckpt"] and report["not_run"] == ["train"]
    text = (tmp_path / "report.txt").read_text()
    assert "ckpt" in text and " ok (kept from an earlier call) (" in text
    refused = pyrecover("bench", "gpu-check", "--out", str(tmp_path), "--allow-cpu",
                        "--budget", "-1")
    assert refused.returncode == 2 and "--budget -1" in refused.stderr, refused.stderr
    short = pyrecover("bench", "gpu-check", "--out", str(tmp_path / "new"), "--allow-cpu",
                      "--budget", "30")  # no step could start: nothing built or written
    assert short.returncode == 2 and short.stderr.strip() == (
        "error: --budget 30: no step starts with less than 60s left; give --budget 60 or "
        "more"), short.stderr
    assert not (tmp_path / "new").exists()


def test_rounds_run_each_mode_again_in_a_rotated_order_and_report_medians(tmp_path, corpus):
    # A run of a mode on an H200 is about 4% apart from the next, as far as the memory
    # figure was from its bound: --rounds gives the ratios as medians of several runs each.
    done = pyrecover("bench", "gpu-check", "--out", str(tmp_path), "--config", str(TINY),
                     "--set", f"data.path={corpus}", "--steps", "2", "--warmup", "1",
                     "--allow-cpu", "--only", "memory-every-step", "--rounds", "2",
                     timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    step = json.loads((tmp_path / "report.json").read_text())["steps"]["memory-every-step"]
    assert step["argv"][step["argv"].index("--repeat") + 1] == "2"
    assert step["report"]["repeat"] == 2
    rows = {r["mode"]: r for r in step["report"]["rows"]}
    assert set(rows) == {"none", "memory"} and rows["memory"]["vs_none"] > 0
    # Where the 6% of a snapshot every step went on the H200 needs a profile of both runs.
    for mode in ("none", "memory"):
        assert rows[mode]["profile"]["steps"] == 3
        assert Path(rows[mode]["profile"]["trace"]).parent == tmp_path / "profile" / mode
    assert "torch.profiler, 3 steps" in (tmp_path / "report.txt").read_text()
    refused = pyrecover("bench", "gpu-check", "--out", str(tmp_path), "--allow-cpu",
                        "--rounds", "0")
    assert refused.returncode == 2 and "--rounds" in refused.stderr, refused.stderr
