"""`pyrecover bench gpu-check`: the GPU paths on this machine, in one report.

On any Linux machine with an NVIDIA GPU and a CUDA torch (no container, SLURM or network):
runs `tests/gpu`, then `bench train` on an experiment (every mode, plus memory mode with a
snapshot every step, and the plain compiled loop as the baseline), then `bench ckpt`, then
`bench memory` (memory mode's snapshots at world size 2 on the CPU cores), then `bench
compile` (a restart's first step with the run's compile cache and without), then `bench
restart --local` (a signal and a crash to the first resumed step without SLURM: the
tiny model on this machine's CPU cores at world sizes 2 and 4, a 1 GB state at world size 2,
and the experiment on the GPU), and writes `report.json` and `report.txt` with the issues'
bounds checked side by side. Each step is the real command in a fresh process, so one that
fails is reported and the next still runs. `--only STEP` runs some of them and keeps the
others from an earlier report of the same device (a machine that limits one command's
time). `make gpu-check` calls it with the defaults.
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pyrecover import startup
from pyrecover.bench.common import BenchError, at_least, make_dir, num
from pyrecover.bench.steps import Step, run_step

Note = Callable[[str], None]

BLOCKED_PER_SAVE = "dcp-async blocked per save / vanilla's"
# (what, the row it reads, the figure, the bound): the figures that decide the GPU issue.
BOUNDS: tuple[tuple[str, str, str, str, float], ...] = (
    ("tokens/s, no checkpoint, vs the plain compiled loop", "train", "none", ">=", 0.95),
    ("tokens/s, dcp-async every interval, vs none", "train", "dcp-async", ">=", 0.95),
    ("tokens/s, memory with a snapshot every step, vs none", "memory-every-step", "memory",
     ">=", 0.95),
    ("loop blocked per dcp-async save vs torch.save + fsync", "ckpt", "dcp-async", "<=", 0.03),
    # The same in training, where the issue means it (gpt-125m, its state on the GPU, a step's
    # compute beside the copy), against vanilla's synchronous save of that state in the same
    # bench: a stricter reference, as vanilla writes faster than torch.save + fsync (bench
    # ckpt: 0.58 of it on the H200 machine's disk).
    ("loop blocked per dcp-async save in training vs vanilla's", "train", BLOCKED_PER_SAVE,
     "<=", 0.03),
    # The same snapshot path on this machine's CPU cores (bench memory, world size 2, the
    # tiny model, train.device=cpu): the CPU bound, on a machine with cores to spare.
    ("tokens/s, memory a snapshot every step vs none, 2 CPU ranks", "memory-cpu",
     "tokens_per_s_vs_none", ">=", 0.90),
    # Issue 13's and 15's bounds on a restart's rest, on this machine's cores with no SLURM
    # (bench restart --local, train.device=cpu, the tiny model): seconds, not ratios.
    ("restart after a signal, world size 2 CPU, no SLURM (s)", "restart-cpu", "signal",
     "<=", 3.0),
    ("restart after a crash, world size 2 CPU, no SLURM (s)", "restart-cpu", "crash",
     "<=", 5.0),
    ("restart after a crash, world size 4 CPU, no SLURM (s)", "restart-cpu-4", "crash",
     "<=", 5.0),
    ("restart after a signal, 1 GB state, world size 2 CPU, no SLURM (s)", "restart-cpu-1gb",
     "signal", "<=", 5.0),
    # The same bound where it is meant: the experiment on the GPU (gpt-125m: 1.5 GB of
    # weights and AdamW state, more than the 1 GB), world size 1 on a 1-GPU machine.
    ("restart after a signal, the experiment on the GPU, no SLURM (s)", "restart-gpu",
     "signal", "<=", 5.0),
)
# Every step, in the order they run; `--only` picks some (the corpus comes with any that
# trains). A report from an earlier call on the same device keeps the steps not run again.
STEPS = ("tests", "train", "memory-every-step", "ckpt", "memory-cpu", "compile", "restart-cpu",
         "restart-cpu-4", "restart-cpu-1gb", "restart-gpu")
TINY = Path(__file__).resolve().parents[2] / "launch" / "experiments" / "tiny.yaml"
NEVER = 1_000_000  # a checkpoint interval no measured run reaches
# --budget: a step starts only with this much of the budget left, and must end this long
# before it runs out (a timed-out bench gets SIGTERM and usually stops within seconds).
MIN_STEP_S = 60.0
BUDGET_MARGIN_S = 20.0


class GpuCheckError(ValueError):
    """The check cannot run here (no CUDA GPU, no such config); one line for a person."""


def parallel_tests() -> list[str]:
    """parallel_tests are pytest's arguments to run tests/gpu 4 at a time where pytest-xdist
    is installed: most of those tests are trainers that leave the GPU idle while they start
    and compile (on an H200: 154 s with 4 workers, more than 260 s one at a time)."""
    import importlib.util

    return ["-n", "4"] if importlib.util.find_spec("xdist") is not None else []


def python_argv() -> list[str]:
    return [sys.executable, "-m", "pyrecover"]


def figure(steps: dict[str, Step], source: str, row: str) -> float | None:
    """figure reads one bound's ratio out of the steps' reports (None where it is missing)."""
    step = steps.get(source)
    if step is None or step.report is None:
        return None
    if source == "memory-cpu":
        return step.report.get("ratios", {}).get(row)
    if source.startswith("restart"):
        summary = step.report.get("summary", {}).get(row, {})
        return (summary.get("figures", {}).get("rest_s") or {}).get("median")
    if row == BLOCKED_PER_SAVE:
        per_save = {r.get("mode"): r["blocked_s"] / r["saves"]
                    for r in step.report.get("rows", []) if r.get("saves")}
        dcp, vanilla = per_save.get("dcp-async"), per_save.get("vanilla")
        return dcp / vanilla if dcp is not None and vanilla else None
    for r in step.report.get("rows", []):
        if source == "ckpt" and r.get("method") == row and r.get("metric") == "blocked":
            return r.get("vs_torch")
        if source != "ckpt" and r.get("mode") == row:
            return r.get("vs_plain") if row == "none" else r.get("vs_none")
    return None


def verdicts(steps: dict[str, Step]) -> list[dict[str, Any]]:
    out = []
    for what, source, row, op, bound in BOUNDS:
        value = figure(steps, source, row)
        met = None if value is None else (value >= bound if op == ">=" else value <= bound)
        out.append({"figure": what, "value": value, "bound": f"{op} {bound}", "met": met})
    return out


def gpu_check(out: Path, config: Path, overrides: list[str], steps: int, warmup: int,
              interval: int, size_gb: float, run_tests: bool = True, allow_cpu: bool = False,
              note: Note = lambda _: None, only: tuple[str, ...] = (),
              cpu_repeat: int = 2, cpu_state_gb: float = 1.0, cpu_steps: int = 60,
              step_timeout: float | None = None, budget_s: float | None = None,
              clock: Callable[[], float] = time.monotonic, rounds: int = 1) -> dict[str, Any]:
    """gpu_check runs every step (or those in `only`) and writes the report into `out`
    after each one (a check cut short still leaves what it measured); returns the report.

    With `budget_s`, the seconds a lease leaves: a step starts only while MIN_STEP_S of it
    are left, with its time limit cut to what is left but BUDGET_MARGIN_S; the steps not
    run are listed in the report (`not_run`). `rounds`: runs of each mode in `train` and
    `memory-every-step` (bench train --repeat: a rotated order each round, medians)."""
    import torch

    unknown = [name for name in only if name not in STEPS]
    if unknown:
        raise GpuCheckError(f"--only {unknown[0]!r}: no such step; the steps are "
                            + ", ".join(STEPS))
    if budget_s is not None and budget_s < MIN_STEP_S:  # else: a corpus built, nothing run
        raise GpuCheckError(f"--budget {budget_s:g}: no step starts with less than "
                            f"{MIN_STEP_S:.0f}s left; give --budget {MIN_STEP_S:.0f} or more")
    # Each step's own bench refuses these too, but only once the check is under way: a
    # corpus built, a report written, the step failed and exit 1 instead of one line.
    try:
        at_least(1, steps=steps, interval=interval, cpu_repeat=cpu_repeat, cpu_steps=cpu_steps)
        at_least(0, warmup=warmup)
    except BenchError as exc:
        raise GpuCheckError(str(exc)) from None
    if not size_gb > 0:
        raise GpuCheckError(f"--size-gb must be > 0 (got {size_gb:g})")
    if not 0 < cpu_state_gb <= 64:  # bench memory's --size-gb and bench restart's --state-gb
        raise GpuCheckError(f"--cpu-state-gb must be in (0, 64] (got {cpu_state_gb:g})")

    if not torch.cuda.is_available() and not allow_cpu:
        raise GpuCheckError(
            f"no CUDA GPU: torch {torch.__version__} (CUDA build {torch.version.cuda}) sees "
            "none; run this on a GPU machine with a CUDA build of torch")
    if not config.is_file():
        raise GpuCheckError(f"config {str(config)!r} does not exist")
    try:
        make_dir(out, "--out")
    except BenchError as exc:
        raise GpuCheckError(str(exc)) from None
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "disabled"}
    own_data = any(item.startswith("data.path=") for item in overrides)
    corpus = out / "corpus.parquet"
    plan: list[tuple[Step, bool]] = []
    if not own_data and not corpus.is_file():
        plan.append((Step("corpus", [*python_argv(), "data", "prepare", "--max-mb", "20",
                                     sysconfig.get_paths()["stdlib"], str(corpus)]), False))
    if run_tests and (not only or "tests" in only):
        repo = Path(__file__).resolve().parents[2]
        # One Inductor cache for every worker (tests/gpu/conftest.py: a cache set wins), so
        # the tiny model compiles once, not once per worker.
        plan.append((Step("tests", [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                    *parallel_tests(), str(repo / "tests" / "gpu")],
                          env={"TORCHINDUCTOR_CACHE_DIR": str(out / "inductor-tests")}), False))
    storage = out / "runs"
    train = [*python_argv(), "bench", "train", "--config", str(config), "--set",
             f"run.storage={storage}", "--steps", str(steps), "--warmup", str(warmup),
             "--interval", str(interval), "--repeat", str(rounds), "--json"]
    if not own_data:
        train += ["--set", f"data.path={corpus}"]
    for item in overrides:
        train += ["--set", item]
    plan.append((Step("train", [*train, "--plain"]), True))
    # A snapshot every step and no disk checkpoint in the measured steps (the figure:
    # the snapshots' cost alone); the last --interval given wins. bench train may round the
    # steps up to multiples of the config's log interval, so "never" is far past any end.
    # Then 3 steps more of each under torch.profiler: whether a snapshot makes the kernels
    # slower or the device wait (profiling.py), with a trace of each in profile/.
    plan.append((Step("memory-every-step", [*train, "--mode", "memory", "--set",
                                            "checkpoint.snapshot_interval=1", "--interval",
                                            str(NEVER), "--profile", "3", "--profile-dir",
                                            str(out / "profile")]), True))
    plan.append((Step("ckpt", [*python_argv(), "bench", "ckpt", "--dir", str(out / "ckpt"),
                               "--size-gb", str(size_gb), "--json"]), True))
    # The benches on the CPU cores train their own small model on the same corpus.
    data = ["--set", next((i for i in overrides if i.startswith("data.path=")),
                          f"data.path={corpus}")]
    (out / "memory").mkdir(exist_ok=True)
    plan.append((Step("memory-cpu", [
        *python_argv(), "bench", "memory", "--dir", str(out / "memory"), "--size-gb",
        str(cpu_state_gb), "--repeat", str(cpu_repeat), "--steps", str(cpu_steps), "--json",
        "--set", "train.device=cpu",
        *data]), True))
    (out / "compile").mkdir(exist_ok=True)
    compile_argv = [*python_argv(), "bench", "compile", "--dir", str(out / "compile"),
                    "--config", str(config), "--repeat", "1", "--json"]
    for item in ([] if own_data else [f"data.path={corpus}"]) + overrides:
        compile_argv += ["--set", item]
    plan.append((Step("compile", compile_argv), True))
    restart = [*python_argv(), "bench", "restart", "--local", "--repeat", str(cpu_repeat),
               "--json", *data]
    cpu = ["--config", str(TINY), "--set", "train.device=cpu"]
    plan.append((Step("restart-cpu", [*restart, "--dir", str(storage), "--nproc", "2", *cpu]),
                 True))
    plan.append((Step("restart-cpu-4", [*restart, "--dir", str(storage), "--nproc", "4",
                                        "--interrupt", "crash", *cpu]), True))
    plan.append((Step("restart-cpu-1gb", [
        *restart, "--dir", str(storage), "--nproc", "2", "--interrupt", "signal", "--state-gb",
        str(cpu_state_gb), *cpu, "--set", "train.global_batch_size=2", "--set",
        "train.micro_batch_size=1"]), True))
    gpu = [*restart, "--dir", str(storage), "--nproc", "1", "--config", str(config)]
    for item in [*overrides, "checkpoint.interval=5"]:  # a crash waits for a checkpoint
        gpu += ["--set", item]
    plan.append((Step("restart-gpu", gpu), True))
    if only:  # in the order asked for (the corpus first): the most wanted first on a lease
        rank = {name: i for i, name in enumerate(("corpus", *dict.fromkeys(only)))}
        plan = sorted([(s, j) for s, j in plan if s.name in rank], key=lambda p: rank[p[0].name])
    if not [s for s, _ in plan if s.name != "corpus"]:
        raise GpuCheckError("nothing to run: --only tests with --no-tests")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    done = earlier_steps(out / "report.json", device, note) if only else {}
    head = {"kind": "gpu-check", "device": device, "torch": torch.__version__,
            "cuda": torch.version.cuda, "cpus": os.cpu_count(), "config": str(config),
            "bytecode": startup.bytecode_origin()}  # a restart's imports depend on it
    head["not_run"] = []
    head["kept"] = sorted(done)  # from the earlier report, until run again
    started = clock()
    for step, json_out in plan:
        limit = step_timeout
        if budget_s is not None:
            left = budget_s - (clock() - started)
            if left < MIN_STEP_S:
                head["not_run"].append(step.name)
                note(f"{step.name}: not run, {max(left, 0):.0f}s of --budget left")
                continue
            limit = min(limit or left, left - BUDGET_MARGIN_S)
        note(f"{step.name}: {' '.join(step.argv[2:])}")
        done[step.name] = run_step(step, out, env, json_out, limit)
        head["kept"] = [name for name in head["kept"] if name != step.name]
        status = "ok" if step.returncode == 0 else f"FAILED (exit {step.returncode})"
        note(f"{step.name}: {status} in {step.seconds:.0f}s")
        write_report(out, head, done)
    return write_report(out, head, done)


def write_report(out: Path, head: dict[str, Any], done: dict[str, Step]) -> dict[str, Any]:
    """write_report writes report.json and report.txt of the steps done so far."""
    done = {name: done[name] for name in ("corpus", *STEPS) if name in done}
    report = {
        **head,
        "steps": {s.name: {"argv": s.argv, "returncode": s.returncode,
                           "seconds": round(s.seconds, 1), "report": s.report, "tail": s.tail}
                  for s in done.values()},
        "bounds": verdicts(done),
    }
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.txt").write_text(format_report(report))
    return report


def earlier_steps(path: Path, device: str, note: Note) -> dict[str, Step]:
    """earlier_steps are the steps of an earlier report on this device (a check split over
    several calls, e.g. a machine's 10-minute command limit); none from another device."""
    try:
        earlier = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if earlier.get("device") != device:
        note(f"{path}: from {earlier.get('device')!r}, not {device!r}; starting a new report")
        return {}
    steps = {name: Step(name, s["argv"], s["seconds"], s["returncode"], s["report"], s["tail"])
             for name, s in earlier.get("steps", {}).items()}
    note(f"keeping {', '.join(steps) or 'no steps'} from {path}")
    return steps


def tests_summary(tail: str) -> str:
    """tests_summary is pytest's closing counts ("3 passed, 1 skipped"), if it printed them."""
    found = re.findall(r"\d+ (?:passed|failed|skipped|errors?)", tail)
    return ", ".join(found) if found else tail.splitlines()[-1] if tail else "no output"


def format_report(report: dict[str, Any]) -> str:
    lines = [f"gpu-check on {report['device']}, torch {report['torch']} (CUDA {report['cuda']}), "
             f"{report['cpus']} CPUs; config {report['config']}",
             f"torch's bytecode: {report.get('bytecode', 'unknown')}", ""]
    kept = set(report.get("kept", ()))
    for name, s in report["steps"].items():
        state = "ok" if s["returncode"] == 0 else f"FAILED (exit {s['returncode']})"
        state += " (kept from an earlier call)" if name in kept else ""
        extra = f": {tests_summary(s['tail'])}" if name == "tests" else ""
        lines.append(f"{name:<18} {state}{extra} ({s['seconds']:.0f}s; log {name}.log)")
    if report.get("not_run"):
        again = " ".join(f"--only {name}" for name in report["not_run"])
        lines.append(f"not run (--budget spent): {', '.join(report['not_run'])}; "
                     f"next time: {again}")
    w = max([58] + [len(b["figure"]) for b in report["bounds"]])  # every row lines up
    lines += ["", f"{'figure':<{w}} {'value':>7} {'bound':>8}  verdict"]
    for b in report["bounds"]:
        value = "-" if b["value"] is None else f"{b['value']:.3f}"
        verdict = {True: "met", False: "NOT met", None: "not measured"}[b["met"]]
        lines.append(f"{b['figure']:<{w}} {value:>7} {b['bound']:>8}  {verdict}")
    ckpt_rows = ((report["steps"].get("ckpt") or {}).get("report") or {}).get("rows", [])
    floor = next((r["vs_torch"] for r in ckpt_rows
                  if r.get("method") == "raw" and r.get("metric") == "blocked"), None)
    if floor is not None:  # what the ckpt bound's blocked time cannot go below on this machine
        lines.append(f"{'one copy of that state in memory vs torch.save + fsync':<{w}} "
                     f"{floor:>7.3f} {'':>8}  (the floor of the ckpt bound)")
    compiled = (report["steps"].get("compile") or {}).get("report")
    if compiled:
        lines.append(f"{'first step of a restart, run compile cache vs empty (s/s)':<{w}} "
                     f"{compiled['cached_vs_uncached']:>7.3f} {'':>8}  "
                     f"({compiled['cached_s']:.1f}s vs {compiled['uncached_s']:.1f}s)")
    restarted = (report["steps"].get("restart-gpu") or {}).get("report")
    if restarted:
        bounded = {row for _, source, row, _, _ in BOUNDS if source == "restart-gpu"}
        for kind, summary in restarted["summary"].items():
            if kind in bounded:  # in the table above
                continue
            rest = (summary["figures"].get("rest_s") or {}).get("median")
            what = f"restart after a {kind}, GPU, world size 1, no SLURM (s)"
            lines.append(f"{what:<{w}} {num(rest, 3):>7}")
    for name in ("train", "memory-every-step"):
        step = report["steps"].get(name, {})
        if step.get("report"):
            from pyrecover.bench.train import format_train

            lines += ["", f"--- bench train ({name}) ---", format_train(step["report"])]
    memory = (report["steps"].get("memory-cpu") or {}).get("report")
    if memory:
        from pyrecover.bench.memory import format_memory

        lines += ["", f"--- bench memory (memory-cpu, {report['cpus']} CPUs) ---",
                  format_memory(memory)]
    for name in ("restart-cpu", "restart-cpu-4", "restart-cpu-1gb", "restart-gpu"):
        step = report["steps"].get(name, {})
        if step.get("report"):
            from pyrecover.bench.restart_local import format_local

            lines += ["", f"--- bench restart --local ({name}) ---", format_local(step["report"])]
    return "\n".join(lines) + "\n"
