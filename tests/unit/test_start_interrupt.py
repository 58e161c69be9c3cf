"""A Ctrl-C while `pyrecover train` still starts (before the run has its stop flag) quits at
once, as Python would, but as one exit code (130, as typer gives it), not a traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import tiny_args

from pyrecover.spawn import catching


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_ctrl_c_while_the_cli_is_imported_quits_with_130_and_no_traceback(tmp_path, nproc):
    argv = ["train", "--nproc", str(nproc),
            *tiny_args(tmp_path, tmp_path / "no-corpus.parquet", "run")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYRECOVER_", "SLURM_"))}
    proc = subprocess.Popen([sys.executable, "-m", "pyrecover", *argv], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    # Its early catch is in (pyrecover/__main__.py): it is importing the CLI now.
    while not catching(proc.pid) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "Traceback" not in err, err
