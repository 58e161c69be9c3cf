"""`pyrecover status STORAGE`: a folder that holds runs lists them, one line per run (or
sweep), newest first; a child it cannot read is a row that says why, never the end of the
list; a folder with no run in it is still the one-line error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import pyrecover, tiny_args
from test_sweep import sweep_of

from pyrecover.sweep import record, trials


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, corpus) -> Path:
    """A storage folder with two real runs, b-older trained before a-newer (so the newest
    first is not the order of their names)."""
    storage = tmp_path_factory.mktemp("trained") / "runs"
    for name, steps in (("b-older", 2), ("a-newer", 3)):
        done = pyrecover("train", *tiny_args(storage, corpus, name, f"train.max_steps={steps}"))
        assert done.returncode == 0, done.stderr
    return storage


def storage_with(two_runs: Path, tmp_path: Path) -> Path:
    """storage_with is a copy of the two runs (their files' times kept) in tmp_path."""
    storage = tmp_path / "runs"
    shutil.copytree(two_runs, storage)  # (copy2: modification times kept)
    return storage


def add_sweep(storage: Path, name: str, n: int) -> Path:
    """add_sweep records a grid sweep of `n` trials in `storage`, as `sweep launch` does."""
    sweep = sweep_of({"method": "grid", "parameters": {
        "train.lr": {"values": [1e-3 * (i + 1) for i in range(n)]}}}, name)
    record.write(storage / name, record.make(sweep, trials.choose(sweep)))
    return storage / name


def test_status_of_a_storage_folder_lists_its_runs_and_sweeps_newest_first(two_runs,
                                                                         tmp_path):
    storage = storage_with(two_runs, tmp_path)
    sweep = add_sweep(storage, "c-sweep", 2)  # the newest
    (storage / "stdlib.parquet").write_text("a corpus beside the runs")
    (storage / "notes").mkdir()  # no run: not listed
    shutil.copytree(storage / "b-older", storage / "project" / "deep")  # two levels down
    done = pyrecover("status", str(storage))
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.splitlines()
    assert header.split() == ["NAME", "STEP", "CHECKPOINT", "JOB", "SLURM", "GOODPUT",
                              "STATE"], header
    assert [row.split()[0] for row in rows] == ["c-sweep", "a-newer", "b-older"], done.stdout
    newer = rows[1].split()
    assert newer[1:4] == ["3/3", "step", "3"] and newer[-1] == "finished", rows[1]
    assert rows[0].endswith(f"sweep of 2 trials: pyrecover sweep status {sweep}"), rows[0]

    listed = json.loads(pyrecover("status", str(storage), "--json").stdout)
    assert [r["name"] for r in listed] == ["c-sweep", "a-newer", "b-older"]
    assert [r["kind"] for r in listed] == ["sweep", "run", "run"]
    assert listed[0]["trials"] == 2 and listed[0]["hint"] == f"pyrecover sweep status {sweep}"
    for row in listed[1:]:  # the same words and figures as `status RUN --json`
        one = json.loads(pyrecover("status", row["path"], "--json").stdout)
        assert row["path"] == str(storage / row["name"])
        assert (row["state"], row["step"], row["max_steps"], row["job_id"]) == (
            one["state"], one["step"], one["max_steps"], one["job_id"]) == (
            "finished", one["max_steps"], one["max_steps"], None)
        assert row["checkpoint_step"] == one["last_checkpoint"]["step"] == row["step"]
        assert row["checkpoint_age_s"] >= 0 and 0 < row["goodput"] <= 1
    assert listed[1]["active"] >= listed[2]["active"]


def test_a_child_that_cannot_be_read_is_a_row_saying_why_and_the_others_are_listed(
        two_runs, tmp_path):
    storage = storage_with(two_runs, tmp_path)
    damaged = add_sweep(storage, "damaged-sweep", 2)
    (damaged / "sweep.yaml").write_text("name: [unclosed\n")
    shutil.copytree(storage / "a-newer", storage / "ckpt-file")
    shutil.rmtree(storage / "ckpt-file" / "checkpoints")
    (storage / "ckpt-file" / "checkpoints").write_text("not a folder")
    shutil.copytree(storage / "a-newer", storage / "garbled")
    (storage / "garbled" / "events.jsonl").write_bytes(b"\x00\xff{not json\n" * 50)
    shutil.copytree(storage / "a-newer", storage / "shut")
    shut = storage / "shut"
    shutil.copytree(storage / "a-newer", storage / "shut-events")
    shut.chmod(0)
    (storage / "shut-events" / "events.jsonl").chmod(0)
    try:
        done = pyrecover("status", str(storage), file_permissions=True)
        as_json = pyrecover("status", str(storage), "--json", file_permissions=True)
    finally:
        shut.chmod(0o755)
        (storage / "shut-events" / "events.jsonl").chmod(0o644)
    assert done.returncode == 0 and as_json.returncode == 0, done.stderr + as_json.stderr
    rows = {r["name"]: r for r in json.loads(as_json.stdout)}
    assert set(rows) == {"a-newer", "b-older", "damaged-sweep", "ckpt-file", "garbled", "shut",
                         "shut-events"}
    assert rows["a-newer"]["state"] == rows["b-older"]["state"] == "finished"
    assert rows["shut"]["state"] == "unreadable: permission denied", rows["shut"]
    assert rows["shut-events"]["state"] == "unreadable: permission denied: events.jsonl"
    assert rows["ckpt-file"]["state"].startswith("unreadable: checkpoints is not a folder")
    assert rows["damaged-sweep"]["state"].startswith("unreadable: sweep.yaml is damaged")
    assert rows["damaged-sweep"]["kind"] == "sweep"
    assert rows["garbled"]["kind"] == "run"  # its records skipped, as `status RUN` does
    text = {line.split()[0]: line for line in done.stdout.splitlines()[1:]}
    assert set(text) == set(rows)
    assert text["shut"].endswith("unreadable: permission denied"), text["shut"]


@pytest.mark.parametrize("inside", ["nothing", "files and a run two levels down"])
def test_a_folder_with_no_run_inside_is_still_the_one_line_error(tmp_path, inside):
    storage = tmp_path / "runs"
    storage.mkdir()
    if inside != "nothing":
        (storage / "stdlib.parquet").write_text("a corpus")
        deep = storage / "project" / "deep"
        deep.mkdir(parents=True)
        (deep / "events.jsonl").write_text("")
    for args in ([], ["--json"]):
        done = pyrecover("status", str(storage), *args)
        assert done.returncode == 2, done.stderr
        assert done.stdout == ""
        assert done.stderr == (f"error: {storage} is not a pyrecover run directory (no "
                               "run.yaml, events.jsonl, metrics.jsonl or checkpoints/)\n")


def test_status_help_says_a_storage_folder_lists_its_runs_one_level_down():
    from typer.testing import CliRunner

    from pyrecover.cli import app

    shown = " ".join(CliRunner().invoke(app, ["status", "--help"],
                                        terminal_width=1000).output.split())
    assert "A run directory (<storage>/<exp_name>), or a storage folder: lists its runs." \
        in shown, shown
    assert "Folders nested deeper than one level are not searched." in shown, shown


def test_a_sweep_of_one_trial_is_said_in_the_singular():
    from pyrecover.status_list import Row
    from pyrecover.status_text import render_rows

    row = Row("s", "sweep", "runs/s", "sweep", trials=1, hint="pyrecover sweep status runs/s")
    assert render_rows([row]).splitlines()[1].endswith(
        "sweep of 1 trial: pyrecover sweep status runs/s")


def test_clearing_bad_nodes_of_a_storage_folder_names_a_run_to_clear_instead(two_runs,
                                                                           tmp_path):
    storage = storage_with(two_runs, tmp_path)
    done = pyrecover("status", str(storage), "--clear-bad-nodes")
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == (f"error: --clear-bad-nodes forgets one run's excluded nodes; "
                           f"{storage} is a storage folder: name a run in it, e.g. pyrecover "
                           f"status {storage / 'a-newer'} --clear-bad-nodes\n"), done.stderr


def test_slurm_is_asked_once_for_every_row_and_a_sweep_shows_its_arrays_states(two_runs,
                                                                            tmp_path):
    """The rows' SLURM states come from one squeue answer (query.my_jobs' lines): a run's job
    where it is queued, a sweep's array where any of its tasks is; `-` where none is."""
    from pyrecover import status_list
    from pyrecover.status_text import render_rows

    storage = storage_with(two_runs, tmp_path)
    sweep = add_sweep(storage, "c-sweep", 3)
    record.add_job(sweep, 812)
    squeue = (f"812_0|RUNNING|{sweep}/sweep.sbatch\n812_[1-2]|PENDING|{sweep}/sweep.sbatch\n"
              "99|RUNNING|/elsewhere/job.sbatch\n")
    rows = {r.name: r for r in status_list.rows(storage, jobs=squeue)}
    assert (rows["c-sweep"].job_id, rows["c-sweep"].slurm_state) == ("812", "PENDING,RUNNING")
    assert [rows[n].slurm_state for n in ("a-newer", "b-older")] == [None, None]
    table = {line.split()[0]: line.split() for line in render_rows(list(rows.values()))
             .splitlines()[1:]}
    assert table["c-sweep"][3:5] == ["812", "PENDING,RUNNING"]


def test_a_sweeps_command_names_its_folder_as_a_shell_reads_it(tmp_path):
    """The command a sweep's row shows is copied into a shell: a storage path with a space
    (or `;`, `$(...)`) in it is quoted there, as `sweep launch` says `follow it: ...`."""
    import shlex

    storage = tmp_path / "my runs; $(x)"
    sweep = add_sweep(storage, "sweep-a", 2)
    done = pyrecover("status", str(storage), "--json")
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)
    assert shlex.split(row["hint"]) == ["pyrecover", "sweep", "status", str(sweep)], row


def test_the_run_clearing_bad_nodes_is_told_to_name_is_quoted_as_a_shell_reads_it(tmp_path):
    """--clear-bad-nodes on a storage folder suggests a command for a run in it: a path with a
    space, `;` or `$(...)` is quoted there, so the command copied runs as shown."""
    import shlex

    run = tmp_path / "my runs; $(x)" / "a run"
    run.mkdir(parents=True)
    (run / "run.yaml").write_text("run:\n  exp_name: a run\n")
    done = pyrecover("status", str(run.parent), "--clear-bad-nodes")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    suggested = done.stderr.rstrip("\n").split("e.g. ", 1)[1]
    assert shlex.split(suggested) == ["pyrecover", "status", str(run), "--clear-bad-nodes"]


def test_a_child_that_can_be_listed_but_not_entered_is_a_row_saying_why(two_runs, tmp_path):
    """A folder with read but no search permission (r--: its names list, its files cannot be
    looked up) is one row that says so; it once ended the whole list with `permission denied:
    .../sweep.yaml` (exit 2), naming a file that is not there."""
    storage = storage_with(two_runs, tmp_path)
    listed_only = storage / "b-older"
    listed_only.chmod(0o444)
    try:
        done = pyrecover("status", str(storage), "--json", file_permissions=True)
    finally:
        listed_only.chmod(0o755)
    assert done.returncode == 0, done.stderr
    rows = {r["name"]: r for r in json.loads(done.stdout)}
    assert rows["a-newer"]["state"] == "finished", rows
    assert rows["b-older"]["state"] == "unreadable: permission denied", rows["b-older"]


def test_clearing_bad_nodes_of_a_storage_folder_names_a_run_beside_one_it_cannot_enter(
        two_runs, tmp_path):
    """A child folder it cannot enter (r--) once hid every run from the suggestion: the error
    said the storage folder was no run directory at all."""
    storage = storage_with(two_runs, tmp_path)
    (storage / "a-newer").chmod(0o444)
    try:
        done = pyrecover("status", str(storage), "--clear-bad-nodes", file_permissions=True)
    finally:
        (storage / "a-newer").chmod(0o755)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    assert done.stderr == (f"error: --clear-bad-nodes forgets one run's excluded nodes; "
                           f"{storage} is a storage folder: name a run in it, e.g. pyrecover "
                           f"status {storage / 'b-older'} --clear-bad-nodes\n"), done.stderr


def test_a_run_past_its_recorded_max_steps_is_not_listed_as_a_fraction():
    from pyrecover.status_list import Row
    from pyrecover.status_text import render_rows

    rows = [Row("past", "run", "runs/past", "finished", step=100, max_steps=30),
            Row("mid", "run", "runs/mid", "stopped (will resume)", step=12, max_steps=30)]
    text = render_rows(rows).splitlines()
    assert "100 (past max_steps 30)" in text[1] and "100/30" not in text[1], text[1]
    assert text[2].split()[:2] == ["mid", "12/30"], text[2]
