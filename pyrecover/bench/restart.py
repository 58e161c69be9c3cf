"""`pyrecover bench restart`: from an interruption to the first resumed step, on a real cluster.

Submits one real job with `pyrecover launch` (to the cluster SLURM_CONF / the cluster profile
points at), waits for it to train, then interrupts it `--repeat` times per kind and waits, on
the run's events and SLURM's job record, for each resume's first step:

- `signal`: `scancel --signal=USR2` to every task (what SLURM sends before a time limit; the
  job stops at the next step boundary, saves, exits 75 and requeues itself);
- `crash`: the job's last rank SIGKILLs itself at the step boundary after the bench creates
  a trigger file in the run directory (`PYRECOVER_KILL_ON_FILE`, pyrecover/faults.py); the
  others see a dead peer, exit, and the job script requeues the crash.

Every figure comes from a clock: the bench's own for the moment it interrupted and the
moment it saw the resumed step, the trainer's `phase` events for each phase in between
(pyrecover/phases.py), and SLURM's for the requeue delay: after a requeue the job's
SubmitTime is the moment of the requeue and its StartTime the next attempt's start (or
`sacct`'s attempts where accounting runs). `rest` is the total minus that delay: what
pyrecover itself, srun and Python spend, which the issue bounds (TARGETS).
"""

from __future__ import annotations

import os
import re
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pyrecover.bench.common import (
    BenchError,
    Note,
    at_least,
    machine,
    make_dir,
    num,
    quiet,
    remove_made,
)
from pyrecover.phases import CHOICE_TIMES, attempts, last_interruption
from pyrecover.rundir import RunDir
from pyrecover.slurm import query

KINDS = ("signal", "crash")
# The bounds on `rest` (seconds): a signal with the tiny state, with a state of about
# 1 GB (--state-gb), and a crash.
TARGETS = {"signal": 3.0, "signal_1gb": 5.0, "crash": 5.0}
POLL_S = 0.2  # how often events.jsonl and SLURM are read while waiting
KILL_FILE = "bench-kill"
TERMINAL = {"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL",
            "OUT_OF_MEMORY", "PREEMPTED", "TIMEOUT"}


def model_for_state(state_gb: float) -> list[str]:
    """model_for_state is the --set overrides of a 4-layer GPT whose weights and AdamW moments
    (12 bytes a parameter) come to about `state_gb` GB."""
    params = state_gb * 1e9 / 12
    # 12 n_layer n_embd^2 in the blocks, plus 257 + 64 positions rows of the embeddings.
    width = max(64, int(((params / 48) ** 0.5) // 64 * 64))
    return ["model.n_layer=4", "model.n_head=8", f"model.n_embd={width}",
            "model.block_size=64", "model.vocab_size=257"]


def launch_argv(name: str, storage: Path, cluster: Path | None, config: Path | None,
                sets: Sequence[str], launch_args: Sequence[str], cycles: int) -> list[str]:
    """launch_argv is the `pyrecover launch` command of the benchmark's job: it trains until
    cancelled, logs every step, and may requeue once per interruption and once more."""
    argv = [sys.executable, "-m", "pyrecover", "launch", "--exp-name", name,
            "--max-restarts", str(cycles + 1), "--set", f"run.storage={storage}"]
    argv += ["--config", str(config)] if config is not None else []
    argv += ["--cluster", str(cluster)] if cluster is not None else []
    for item in [*sets, "train.max_steps=1000000", "train.log_interval=1"]:
        argv += ["--set", item]
    return argv + list(launch_args)


def bench_restart(storage: Path, cluster: Path | None, config: Path | None,
                  sets: Sequence[str], launch_args: Sequence[str], kinds: Sequence[str],
                  repeat: int, state_gb: float | None, timeout: float = 600.0,
                  note: Note = quiet) -> dict[str, Any]:
    """bench_restart runs the benchmark (see the module) and returns its report."""
    check_args(kinds, repeat, state_gb, timeout)
    storage = storage.resolve()
    made = make_dir(storage)
    name = f"bench-restart-{uuid.uuid4().hex[:8]}"
    run = RunDir(storage / name)
    sets = [*(model_for_state(state_gb) if state_gb else []), *sets]
    env = {**os.environ, "PYRECOVER_KILL_ON_FILE": str(run.root / KILL_FILE),
           "PYRECOVER_KILL_RANK": "last", "PYRECOVER_KILL_TARGET": "self"}
    argv = launch_argv(name, storage, cluster, config, sets, launch_args, len(kinds) * repeat)
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:  # (it may have submitted: the folder stays)
        raise BenchError("pyrecover launch did not answer in 120 s (is SLURM's controller "
                         "up? `sinfo` tells); check `squeue --me` for a job it may have "
                         "submitted") from None
    found = re.search(r"^submitted job (\d+)$", done.stdout, re.M)
    if done.returncode != 0 or not found:
        if done.returncode != 0:  # refused, nothing submitted: no folder of the bench's stays
            remove_made(storage, made)
        said = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError("pyrecover launch failed: " + said.removeprefix("error: "))
    job = found.group(1)
    note(f"job {job}, run directory {run.root}")
    waiter = Waiter(job, run, timeout)
    try:
        cycles = run_cycles(waiter, interrupt, kinds, repeat, note)
    finally:
        query.cancel_job(job)
        waiter.ended()
    return {"job": job, **results(run, cycles, state_gb), "machine": machine(storage)}


def run_cycles(waiter: Any, interrupt: Callable[[Any, str, int], dict[str, Any]],
               kinds: Sequence[str], repeat: int, note: Note) -> list[dict[str, Any]]:
    """run_cycles interrupts the run `repeat` times per kind (`interrupt(waiter, kind,
    attempt)`: one cycle of the report), each after two steps of the attempt it interrupts
    (and, for a crash, a committed checkpoint, else the next attempt starts afresh). `waiter`
    has the run (`.run`) and waits (`.until(check, what)`): a job's, or local processes'."""
    run, cycles = waiter.run, []
    current = waiter.until(lambda: stepping(run, 0), "the first step")[0]
    for i, kind in enumerate([k for _ in range(repeat) for k in kinds]):
        waiter.until(lambda a=current: steps_after_first(run, a) >= 2,
                     f"two steps of attempt {current + 1}")
        if kind == "crash":
            waiter.until(lambda: has_checkpoint(run), "a committed checkpoint")
        note(f"{kind} {i // len(kinds) + 1}/{repeat}")
        cycles.append(interrupt(waiter, kind, current))
        c = cycles[-1]
        current = c["attempt"]
        if c["failed_starts"]:
            note(f"{kind}: {c['failed_starts']} start(s) failed before the resume (see "
                 f"{run.logs}); this run is left out of the summary")
            continue
        note(f"{kind}: {c['total_s']:.2f}s to the first resumed step, requeue delay "
             f"{num(c['requeue_delay_s'], 0)}s, rest {num(c['rest_s'], 2)}s")
    return cycles


def results(run: RunDir, cycles: list[dict[str, Any]], state_gb: float | None
            ) -> dict[str, Any]:
    """results is what a report says of the run besides the machine: its world size, state,
    cycles and their summary."""
    world = next((e.get("world_size") for e in run.read_events() if e["event"] == "resume"),
                 None)
    return {"run_dir": str(run.root), "world_size": world, "state_gb": state_gb,
            "state_bytes": state_bytes(run), "cycles": cycles,
            "summary": summarize(cycles, state_gb)}


def check_args(kinds: Sequence[str], repeat: int, state_gb: float | None,
               timeout: float) -> None:
    """check_args refuses, in one line, what the benchmark cannot run (before it starts)."""
    bad = [k for k in kinds if k not in KINDS]
    if bad or not kinds:
        raise BenchError(f"--interrupt must be one of {', '.join(KINDS)} "
                         f"(got {', '.join(bad) or 'none'})")
    at_least(1, repeat=repeat)
    if state_gb is not None and not 0 < state_gb <= 64:
        raise BenchError(f"--state-gb must be in (0, 64] (got {state_gb:g})")
    if not timeout > 0:  # nan too: every wait would end at once, after a job was submitted
        raise BenchError(f"--timeout must be a number of seconds > 0 (got {timeout:g})")


class Waiter:
    """Waiter polls the run's events and the job until a condition holds or the job ends."""

    def __init__(self, job: str, run: RunDir, timeout: float) -> None:
        self.job, self.run, self.timeout = job, run, timeout

    def ended(self) -> None:
        """ended waits (up to the timeout) for SLURM to report the job ended."""
        deadline = time.monotonic() + self.timeout
        while query.job_record(self.job).get("JobState", "COMPLETED") not in TERMINAL:
            if time.monotonic() > deadline:
                return
            time.sleep(POLL_S)

    def until(self, check: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + self.timeout
        polls = 0
        while not (result := check()):
            polls += 1
            if polls % 10 == 0:  # SLURM is asked every 2 s, the files every 0.2 s
                state = query.job_record(self.job).get("JobState")
                if state in TERMINAL:
                    raise BenchError(f"job {self.job} ended ({state}) while waiting for "
                                     f"{what}; see {self.run.logs}")
            if time.monotonic() > deadline:
                raise BenchError(f"no {what} after {self.timeout:.0f}s (job {self.job}; is "
                                 f"the cluster busy? see {self.run.logs})")
            time.sleep(POLL_S)
        return result


def interrupt(waiter: Waiter, kind: str, index: int) -> dict[str, Any]:
    """interrupt ends attempt `index` the `kind` way and measures until the first step of the
    next attempt that gets that far (one cycle of the report; `failed_starts` counts the
    attempts between that failed to start, say a rendezvous port still taken)."""
    run = waiter.run
    sent = time.time()
    if kind == "signal":
        query.signal_job(waiter.job, "USR2")
    else:
        (run.root / KILL_FILE).write_text(f"{sent}\n")
    resumed, step = waiter.until(lambda: stepping(run, index + 1), "the first resumed step")
    seen = time.time()
    runs = attempts(run.read_events())
    restarts = _restart_count(runs[resumed])
    if restarts == _restart_count(runs[index]):
        delay: float | None = 0.0  # restarted inside the allocation (spare nodes): no requeue
    else:
        record = waiter.until(lambda: _restarted(waiter.job, restarts), "SLURM's record of "
                              "the restart")
        delay = _sacct_delay(waiter.job, restarts)
        delay = query.requeue_delay(record) if delay is None else delay
    return cycle(kind, sent, seen, step, runs[index] + runs[resumed], resumed - index - 1,
                 resumed, delay)


def cycle(kind: str, sent: float, seen: float, step: float, events: list[dict[str, Any]],
          failed_starts: int, resumed: int, delay: float | None) -> dict[str, Any]:
    """cycle is one interruption's report: the phases of `events` (the interrupted attempt's
    and the resumed one's) from the moment `sent` to the resumed `step`, each with its gap."""
    rows = [{"phase": f"{kind}_sent", "time": sent}]
    rows += [r for r in last_interruption(events) if r["phase"] != "last_record"]
    previous = sent
    for row in rows:
        row["gap"] = round(row["time"] - previous, 3)
        previous = row["time"]
    total = step - sent
    return {"kind": kind, "attempt": resumed, "failed_starts": failed_starts,
            "rows": rows, "total_s": round(total, 3),
            "observed_s": round(seen - sent, 3), "requeue_delay_s": delay,
            "rest_s": None if delay is None else round(total - delay, 3)}


def has_checkpoint(run: RunDir) -> bool:
    """has_checkpoint: the run has committed a checkpoint (sizes checked, not checksums)."""
    from pyrecover.checkpoint import store

    return any(ckpt is not None for _, _, ckpt, _ in store.scan(run.checkpoints, False))


def _restart_count(attempt: list[dict[str, Any]]) -> int:
    """_restart_count is SLURM's restart count (requeues) of an attempt's records."""
    return max((int(e.get("restart_count", 0)) for e in attempt), default=0)


def stepping(run: RunDir, index: int) -> tuple[int, float] | None:
    """stepping is (attempt, time of its first step) for the first attempt from `index` on
    that took a step, once one has."""
    for i in range(index, len(attempts(run.read_events()))):
        if (at := _first_step(run, i)) is not None:
            return i, at
    return None


def _first_step(run: RunDir, index: int) -> float | None:
    """_first_step is when attempt `index` (0 = the first) took its first step, once it has."""
    runs = attempts(run.read_events())
    if len(runs) <= index:
        return None
    return next((float(e["time"]) for e in runs[index]
                 if e["event"] == "phase" and e.get("phase") == "first_step"), None)


def steps_after_first(run: RunDir, index: int) -> int:
    """steps_after_first counts the steps attempt `index` logged after its first step."""
    first = _first_step(run, index)
    if first is None:
        return 0
    return sum(1 for m in run.read_metrics() if float(m.get("time", 0)) > first)


def _restarted(job: str, restarts: int) -> dict[str, str] | None:
    record = query.job_record(job)
    done = record.get("Restarts", "0").isdigit() and int(record["Restarts"]) >= restarts
    return record if done and record.get("JobState") != "PENDING" else None


def _sacct_delay(job: str, attempt: int) -> float | None:
    """_sacct_delay is accounting's gap between attempt `attempt - 1`'s end and `attempt`'s
    start (None where accounting is off)."""
    times = query.job_times(job)
    if len(times) <= attempt or times[attempt - 1][2] is None:
        return None
    return times[attempt][1] - times[attempt - 1][2]


def state_bytes(run: RunDir) -> int | None:
    sizes = [e.get("bytes") for e in run.read_events() if e["event"] == "checkpoint"]
    return sizes[-1] if sizes else None


def summarize(cycles: list[dict[str, Any]], state_gb: float | None) -> dict[str, Any]:
    """summarize is, per kind, the median/min/max of every phase gap, the total, the requeue
    delay and the rest, with the issue's bound on the rest."""
    out: dict[str, Any] = {}
    for kind in dict.fromkeys(c["kind"] for c in cycles):
        mine = [c for c in cycles if c["kind"] == kind and not c["failed_starts"]]
        figures: dict[str, list[float]] = {}
        for c in mine:
            for row in c["rows"][1:]:
                figures.setdefault(row["phase"], []).append(row["gap"])
                for key in CHOICE_TIMES:  # inside checkpoint_chosen's gap, where recorded
                    if key in row:
                        figures.setdefault(key, []).append(row[key])
            for key in ("total_s", "requeue_delay_s", "rest_s"):
                if c[key] is not None:
                    figures.setdefault(key, []).append(c[key])
        target = TARGETS["signal_1gb" if kind == "signal" and state_gb else kind]
        rest = figures.get("rest_s")
        out[kind] = {"runs": len(mine), "target_rest_s": target,
                     "met": None if not rest else statistics.median(rest) <= target,
                     "figures": {k: {"median": statistics.median(v), "min": min(v),
                                     "max": max(v)} for k, v in figures.items()}}
    return out


LABELS = {"signal_seen": "signal -> seen by the trainer",
          "stop_agreed": "-> stop agreed by every rank", "save_done": "-> stop checkpoint saved",
          "exit": "-> process exit", "process_start": "-> next process started",
          "imports_done": "-> imports done", "data_ready": "-> data ready",
          "group_up": "-> process group up", "checkpoint_chosen": "-> checkpoint chosen",
          "built_s": "     model, optimizer built", "verify_s": "     checksum pass (beside)",
          "wait_s": "     then waited for it",
          "restored": "-> restored", "first_step": "-> first step done",
          "total_s": "total", "requeue_delay_s": "  of which SLURM's requeue delay",
          "rest_s": "  rest (total - delay)"}


def format_restart(report: dict[str, Any]) -> str:
    """format_restart is the report as the tables the README shows."""
    m = report["machine"]
    size = report["state_bytes"]
    lines = [f"bench restart: job {report['job']}, world size {report['world_size']}, "
             f"checkpoint {num(size / 1e9 if size else None, 3)} GB; {m.get('cpus')} CPUs "
             f"({m.get('cpu', '?')}), load {m.get('load_avg_1m')}; seconds"]
    for kind, s in report["summary"].items():
        met = {True: "met", False: "MISSED", None: "unknown"}[s["met"]]
        lines += ["", f"{kind} ({s['runs']} runs)    median     min     max",
                  "-" * 56]
        for key, f in s["figures"].items():
            label = LABELS.get(key) or key
            if key == "exit" and kind == "crash":
                label = "kill -> survivors exit"
            lines.append(f"{label:<34}{f['median']:>8.2f}{f['min']:>8.2f}{f['max']:>8.2f}")
        lines.append(f"bound on the rest: {s['target_rest_s']:g}s ({met})")
    return "\n".join(lines) + "\n"
