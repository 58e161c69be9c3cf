"""`python -m pyrecover train` runs its start-up imports with the garbage collector off and
turns it back on, start-up frozen, before training (pyrecover/__main__.py, startup.py); no
other command ever runs without it."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import tiny_args

# The CLI as `python -m pyrecover ARGS` runs it, then what it left the collector as.
PROBE = """
import gc, runpy, sys
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
