"""`pyrecover launch` of a run whose directory cannot be made because a file is in the way:
one line, exit 2, with --dry-run as without (--dry-run passed it, and the launch then said
`storage: cannot create ...: Not a directory` and exited 1, the code of a fault)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import TINY, default_cluster, pyrecover


def launch(tmp_path: Path, *args: str):
    """`pyrecover launch` of the tiny run from tmp_path, with no sbatch on PATH."""
    return pyrecover("launch", "--config", str(TINY), "--launcher", "none", *args,
                     env={**default_cluster(tmp_path), "PATH": "/nonexistent"}, cwd=tmp_path)


@pytest.mark.parametrize("dry_run", [["--dry-run"], []])
@pytest.mark.parametrize("storage, name, blocker", [
    ("notes", "exp", "notes"),  # the storage folder is a file
    ("store", "exp", "store/exp"),  # the run directory is a file
])
def test_a_file_where_the_run_directory_goes_is_one_line_exit_2(tmp_path, dry_run, storage,
                                                                 name, blocker):
    (tmp_path / "store").mkdir()
    (tmp_path / "notes").write_text("mine\n")
    (tmp_path / "store" / "exp").write_text("mine\n")
    done = launch(tmp_path, "--set", f"run.storage={storage}", "--exp-name", name, *dry_run)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and "#SBATCH" not in done.stdout
    root = tmp_path / storage / name
    assert done.stderr.splitlines() == [(
        f"error: run directory {root} cannot be made: {tmp_path / blocker} is a file, not a "
        "folder; set run.storage to a folder of runs (--set run.storage=DIR), or choose "
        "another --exp-name")]
    assert (tmp_path / blocker).read_text() == "mine\n"
