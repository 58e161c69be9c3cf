"""`python -m pyrecover train` runs its start-up imports with the garbage collector off and
turns it back on, start-up frozen, before training (pyrecover/__main__.py, startup.py); no
other command ever runs without it."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import tiny_args

# The CLI as `python -m pyrecover ARGS` runs it, then what it left the collector as. A trainer
# ends with os._exit (dist.exit_now), which would end the probe too: here it only exits.
PROBE = """
import gc, runpy, sys
import pyrecover.dist
pyrecover.dist.exit_now = sys.exit
sys.argv = ["pyrecover", *sys.argv[1:]]
try:
    runpy.run_module("pyrecover", run_name="__main__")
except SystemExit:
    pass
print("GC", gc.isenabled(), gc.get_freeze_count() > 0)
"""


def probe(*args: str, cwd) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    env["WANDB_MODE"] = "disabled"
    done = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("GC ")]
    assert lines, done.stderr[-3000:]
    return lines[-1].split()[1:]


def test_the_trainer_turns_the_collector_back_on_with_its_start_up_frozen(tmp_path, corpus):
    # Frozen only where the collector was off through the imports: end_startup_imports ran.
    assert probe("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=2"),
                 cwd=tmp_path) == ["True", "True"]


def test_another_command_never_turns_the_collector_off(tmp_path):
    assert probe("ckpt", "list", str(tmp_path / "absent"), cwd=tmp_path) == ["True", "False"]


def test_a_lone_trainer_ends_without_the_interpreter_s_shutdown_and_loses_no_output(
        tmp_path, corpus):
    # The shutdown (exit handlers, module teardown) is time a restart waits for: 1.98-5.20 s
    # of a GPU trainer's on the H200 machine. The exit code and the last lines still come.
    code = ("import atexit, runpy, sys\n"
            "atexit.register(lambda: print('SHUTDOWN RAN', flush=True))\n"
            "sys.argv = ['pyrecover', *sys.argv[1:]]\n"
            "runpy.run_module('pyrecover', run_name='__main__')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    done = subprocess.run([sys.executable, "-c", code, "train",
                           *tiny_args(tmp_path, corpus, "run", "train.max_steps=2")],
                          env={**env, "WANDB_MODE": "disabled"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished at step 2" in done.stderr
    assert "SHUTDOWN RAN" not in done.stdout
    # A command that trains nothing shuts down as usual.
    listed = subprocess.run([sys.executable, "-c", code, "ckpt", "list", str(tmp_path / "no")],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "SHUTDOWN RAN" in listed.stdout
