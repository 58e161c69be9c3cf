"""One step of `bench gpu-check`: a command run in a session of its own with its whole output
in a log, stopped with everything it started past its time limit (gpu_check.py runs them)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# After SIGTERM, how long a timed-out step may take to stop what it started before its
# process group is killed: longer than bench restart's own stop (its trainer gets 60 s to save
# and exit, then SIGKILL, then 60 s more for its watcher), so that one finishes first.
STOP_GRACE_S = 150.0
# Every process a step starts inherits this variable (a name the tests' CLI helper keeps):
# what a timed-out step left running in sessions of its own is found by it and killed.
STEP_MARK = "GPU_CHECK_STEP"


@dataclass
class Step:
    name: str
    argv: list[str]
    seconds: float = 0.0
    returncode: int | None = None
    report: dict[str, Any] | None = None
    tail: str = ""
    env: dict[str, str] = field(default_factory=dict)  # on top of the check's own


def run_step(step: Step, out: Path, env: dict[str, str], json_out: bool,
             timeout_s: float | None = None) -> Step:
    """run_step runs one command, its whole output saved to `<out>/<name>.log`. Past
    `timeout_s` the command's process group gets SIGTERM (a bench stops what it started in
    sessions of their own, such as bench restart's trainer), then SIGKILL after
    `STOP_GRACE_S` (a hang must not take the rest of the check with it), and the step says
    so."""
    started = time.perf_counter()
    mark = f"{os.getpid()}-{step.name}-{time.monotonic_ns()}"
    proc = subprocess.Popen(step.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env, **step.env, STEP_MARK: mark},
                            start_new_session=True)
    late = ""
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):  # it may have ended just now
            os.killpg(proc.pid, signal.SIGTERM)
        stdout, stderr = stop(proc, mark)
        kill_marked(mark)  # what it started elsewhere, holding its pipes or not
        late = f"killed after {timeout_s:.0f}s (--step-timeout)"
    step.seconds = time.perf_counter() - started
    step.returncode = proc.returncode
    (out / f"{step.name}.log").write_text(
        f"$ {' '.join(step.argv)}\n{stdout}\n--- stderr ---\n{stderr}\n{late}")
    step.tail = "\n".join([*(stdout + stderr).strip().splitlines()[-5:], *[late][:bool(late)]])
    if json_out and stdout.strip():
        try:  # a bench that measured some rows and failed others still reports them
            step.report = json.loads(stdout)
        except json.JSONDecodeError:
            if proc.returncode == 0:
                step.tail = "its output was not the JSON report"
    return step


def stop(proc: subprocess.Popen, mark: str) -> tuple[str, str]:
    """stop collects the output of a step that was sent SIGTERM, once it ended: its process
    group gets SIGKILL after STOP_GRACE_S, and what it started elsewhere is killed as soon as it
    has ended (a test's CLI in its own session outlives pytest's SIGTERM; a trainer left
    running would hold the GPU under the next steps, and its pipes would keep this waiting)."""
    deadline = time.monotonic() + STOP_GRACE_S
    while True:
        try:
            return proc.communicate(timeout=1.0)  # output read so far is kept between tries
        except subprocess.TimeoutExpired:
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            kill_marked(mark)
            if time.monotonic() > deadline + 30:  # the pipes are held by what we cannot find
                for pipe in (proc.stdout, proc.stderr):
                    if pipe is not None:
                        pipe.close()
                proc.wait()
                return "", "(its output was lost: something it started held the pipes open)"


def kill_marked(mark: str) -> list[int]:
    """kill_marked SIGKILLs every process whose environment carries `STEP_MARK=mark`: what
    one step started, wherever it went (another session, another parent); their pids."""
    wanted = f"{STEP_MARK}={mark}".encode()
    killed = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            os.kill(int(entry.name), signal.SIGKILL)
        except (OSError, ProcessLookupError):  # gone meanwhile, or not ours to read
            continue
        killed.append(int(entry.name))
    return killed


