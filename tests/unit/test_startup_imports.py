"""What a trainer imports before its first step: only what that run needs (start-up time)."""

from __future__ import annotations

import subprocess
import sys

from pyrecover.checkpoint import store
from pyrecover.checkpoint.memory import layout


def imported_by(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(*sys.modules)"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_the_trainer_does_not_import_distributed_checkpoint_or_wandb_until_a_run_needs_them():
    # torch.distributed.checkpoint alone took 1-2.5 s of every rank's start on this machine.
    modules = imported_by("import pyrecover.cli.app, pyrecover.train")
    assert "torch.distributed.checkpoint" not in modules
    assert "wandb" not in modules


def test_pyrecover_train_imports_no_other_command_groups_work_before_it_trains():
    # Each restart pays for every import again; the other groups' modules wait for their
    # own commands (the typer modules of cli/ themselves are 0.2 s in all, typer included).
    modules = imported_by("import pyrecover.cli.app, pyrecover.train")
    others = {"pyrecover.bench", "pyrecover.sweep", "pyrecover.plot", "pyrecover.status",
              "pyrecover.slurm.render", "pyrecover.container", "spython", "matplotlib"}
    assert not others & modules, others & modules


def test_a_dcp_mode_is_still_made_on_demand():
    modules = imported_by("import torch\nfrom pyrecover.checkpoint.modes import ModeSettings, "
                          "make_mode\nmake_mode('dcp', 0, 1, ModeSettings(torch.device('cpu'), "
                          "False, 1, None))")
    assert "torch.distributed.checkpoint" in modules


def test_the_manager_looks_for_snapshots_where_memory_mode_leaves_them():
    assert store.SNAPSHOT_GLOB == layout.SNAP_PREFIX + "*"
