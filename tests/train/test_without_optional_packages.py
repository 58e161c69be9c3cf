"""A GPU machine may have torch and nothing else of ours: `make gpu-check` installs the package
with --no-deps. Training and the benchmarks must then run without wandb and spython."""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, tiny_args

BLOCKED = """
import runpy, sys
class Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("wandb", "spython"):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Missing())
sys.argv = ["pyrecover", *sys.argv[1:]]
runpy.run_module("pyrecover", run_name="__main__")
"""


def test_training_runs_where_wandb_and_spython_are_not_installed(tmp_path, corpus):
    args = tiny_args(tmp_path, corpus, "bare", "train.max_steps=4", "checkpoint.mode=dcp",
                     "checkpoint.interval=2")
    done = subprocess.run([sys.executable, "-c", BLOCKED, "train", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "WANDB_MODE": "disabled"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "finished at step 4" in done.stderr
