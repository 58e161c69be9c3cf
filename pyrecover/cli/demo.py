"""`pyrecover demo`: the whole promise on one laptop, no cluster and no GPU.

Builds a corpus from the Python standard library's sources, trains the embedded default GPT
with local worker processes, SIGKILLs the whole process group part-way (no signal handler,
nothing flushed), runs the very same command again, and shows that it resumed from the last
committed checkpoint and that the loss kept going down across the kill.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path

from pyrecover import config as config_mod
from pyrecover import datasource
from pyrecover.rundir import RunDir, read_jsonl
from pyrecover.runlock import RunLocked, live_holder

KILL_AFTER_STEPS = 30  # steps past the first checkpoint: work the kill throws away
DEMO_RUN = "local-demo"  # <workdir>/local-demo, replaced at every demo
CORPUS_MAX_BYTES = 5_000_000  # the README's `data prepare ... --max-mb 5` builds the same file


def say(text: str) -> None:
    print(f"\n=== {text}", flush=True)


def run(workdir: Path, nproc: int) -> int:
    corpus = workdir / "stdlib.parquet"
    # Offline wandb: the demo never touches the network, even where an API key is set. Its
    # run has a name of its own: it removes the previous one, and `train`/`launch` on the
    # defaults (run `demo`) must find neither it gone nor its world size's batch recorded.
    overrides = [f"run.storage={workdir}", f"data.path={corpus}", "tracking.wandb=offline",
                 f"run.exp_name={DEMO_RUN}"]
    cfg = config_mod.load(None, overrides)
    run_dir = RunDir(cfg.run_dir())
    holder = live_holder(run_dir)  # (another demo in this folder): not removed under it
    if holder:
        raise RunLocked(f"the previous demo run {run_dir.root} is in use by a live run "
                        f"({holder}): let it finish, or give this demo another --workdir")
    if not corpus.is_file():
        stdlib = sysconfig.get_paths()["stdlib"]
        say(f"building the corpus from the standard library's .py files in {stdlib}")
        done = datasource.prepare(stdlib, corpus, (".py",), max_bytes=CORPUS_MAX_BYTES)
        print(done.summary(corpus))
    if run_dir.root.exists():
        say(f"removing the previous demo run {run_dir.root}")
        shutil.rmtree(run_dir.root)
    argv = [sys.executable, "-m", "pyrecover", "train", "--nproc", str(nproc)]
    for item in overrides:
        argv += ["--set", item]
    command = shlex.join(argv)  # as a shell takes it: copy it to run it by hand
    interval = cfg.checkpoint.interval

    say(f"training with {nproc} processes: {command}")
    with _ended_with_the_demo(subprocess.Popen(argv, start_new_session=True)) as first:
        killed_at = _kill_after_checkpoint(first, run_dir, 2 * interval + KILL_AFTER_STEPS)
    if killed_at is None:
        print(f"error: the first run ended by itself with exit code {first.returncode} before "
              "it could be killed", file=sys.stderr)
        return 1
    last_ckpt = max((e["step"] for e in read_jsonl(run_dir.events)
                     if e.get("event") == "checkpoint"), default=0)
    say(f"SIGKILL sent to the whole process group at step {killed_at}; the last committed "
        f"checkpoint is step {last_ckpt}")

    say(f"running the same command again: {command}")
    with _ended_with_the_demo(subprocess.Popen(argv, start_new_session=True)) as second:
        code = second.wait()
    if code != 0:
        print(f"error: the resumed run failed with exit code {code}", file=sys.stderr)
        return code
    return _summary(run_dir, killed_at)


@contextlib.contextmanager
def _ended_with_the_demo(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """_ended_with_the_demo stops the training `proc` (its own session, so that the demo can
    kill all of it) when the demo itself is stopped: a Ctrl-C or a SIGTERM of the demo left
    it training to the end. It gets SIGTERM, a clean stop, and is waited for."""
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        yield proc
    except BaseException:
        if proc.poll() is None:
            print("\n=== the demo was stopped: stopping its run cleanly", flush=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        raise
    finally:
        signal.signal(signal.SIGTERM, before)


def _kill_after_checkpoint(proc: subprocess.Popen, run_dir: RunDir, kill_step: int) -> int | None:
    """Wait until the run logs `kill_step`, then SIGKILL its process group; None if it ended."""
    while proc.poll() is None:
        logged = [m["step"] for m in read_jsonl(run_dir.metrics)]
        if logged and max(logged) >= kill_step:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return max(logged)
        time.sleep(0.2)
    return None


def _summary(run_dir: RunDir, killed_at: int) -> int:
    events = list(read_jsonl(run_dir.events))
    resume = next((e for e in events if e.get("event") == "resume"), None)
    if resume is None:
        print("error: the second run did not resume from a checkpoint", file=sys.stderr)
        return 1
    losses: dict[int, float] = {}
    for m in read_jsonl(run_dir.metrics):
        losses[m["step"]] = m["loss"]  # a redone step's later value wins
    steps = sorted(losses)
    before = max(s for s in steps if s <= killed_at)
    last = steps[-1]
    say("summary")
    print(f"resumed from {resume['path']} (step {resume['step']}); "
          f"{resume.get('steps_lost', 0)} steps were redone")
    print(f"loss: step {steps[0]} {losses[steps[0]]:.3f} -> step {before} (killed) "
          f"{losses[before]:.3f} -> step {last} (finished) {losses[last]:.3f}")
    print(f"run directory: {run_dir.root}  (try: pyrecover ckpt ls {run_dir.root})")
    if not losses[last] < losses[before] < losses[steps[0]]:
        print("error: the loss did not keep going down across the kill", file=sys.stderr)
        return 1
    return 0
