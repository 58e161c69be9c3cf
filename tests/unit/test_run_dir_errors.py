"""A run directory that is not one, is given oddly, or has no job to cancel: one line, the
right exit code, and the run left as it was."""

from __future__ import annotations

from helpers import TINY, files_under, pyrecover, tiny_args


def test_a_file_given_as_the_run_directory_is_called_a_file(tmp_path):
    (tmp_path / "afile").write_text("mine")
    for args in (["status"], ["ckpt", "ls"], ["plot"]):
        done = pyrecover(*args, str(tmp_path / "afile"), cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip() == (f"error: run directory '{tmp_path / 'afile'}' is a "
                                       "file, not a folder"), done.stderr
    assert (tmp_path / "afile").read_text() == "mine"


def test_a_run_started_with_run_dir_dot_is_resumed_by_the_same_command(tmp_path, corpus):
    """`--run-dir .` recorded run.exp_name '' (the name of Path('.')) and the folder above as
    run.storage, and the very same command then refused to start: "run.yaml (the run's
    recorded config): run.exp_name='' is not allowed"."""
    import yaml

    here = tmp_path / "my-run"
    here.mkdir()
    args = ["train", "--config", str(TINY), "--set", f"data.path={corpus}", "--set",
            "train.max_steps=1", "--run-dir", "."]
    first = pyrecover(*args, cwd=here)
    assert first.returncode == 0, first.stderr
    recorded = yaml.safe_load((here / "run.yaml").read_text())["run"]
    assert (recorded["storage"], recorded["exp_name"]) == (str(tmp_path), "my-run")
    again = pyrecover(*args, cwd=here)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr, again.stderr


def test_a_run_given_its_run_dir_logs_the_storage_it_lives_in(tmp_path, corpus):
    """With --run-dir the logged config (and wandb's copy of it) said the run's own name with
    the config's run.storage, a folder the run is not in (`exp_name=elsewhere storage=S`:
    S/elsewhere does not exist), where run.yaml records where it is."""
    args = tiny_args(tmp_path / "config-storage", corpus, "tiny", "train.max_steps=1")
    done = pyrecover("train", *args, "--run-dir", str(tmp_path / "elsewhere"))
    assert done.returncode == 0, done.stderr
    assert f"config run: exp_name=elsewhere storage={tmp_path} " in done.stderr, done.stderr


def test_ckpt_commands_on_a_folder_that_is_not_a_run_say_so(tmp_path):
    for args in (["ls", str(tmp_path)], ["verify", str(tmp_path / "nope")],
                 ["export", str(tmp_path), "--out", str(tmp_path / "m.pt")]):
        done = pyrecover("ckpt", *args)
        assert done.returncode == 2
        assert done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1


def test_a_run_whose_checkpoints_folder_is_a_file_is_refused_not_shown_as_empty(tmp_path):
    # ckpt ls said "no checkpoints yet" (exit 0) and status "stopped (resumes when started
    # again)", though no start could resume from it.
    (tmp_path / "events.jsonl").write_text("")
    (tmp_path / "checkpoints").write_text("not a folder")
    for args in (["ckpt", "ls", str(tmp_path)], ["status", str(tmp_path)]):
        done = pyrecover(*args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert done.stderr.splitlines() == [
            f"error: {tmp_path / 'checkpoints'} is not a folder: a run keeps its checkpoints "
            "in a folder of that name; move the file away"], args


def test_cancel_of_a_run_no_slurm_job_started_or_of_no_run_says_so_in_one_line(tmp_path):
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "local")
    run.create()
    run.event("start", step=0)  # a local run: no job id
    for target, said in ((run.root, "has no SLURM job to cancel"),
                         (tmp_path / "nope", "does not exist")):
        done = pyrecover("cancel", str(target))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and said in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1


def test_cancel_while_slurm_does_not_answer_says_so_not_that_nothing_runs(tmp_path):
    """With the controller down, cancel said the run's job was 'not queued or running (SLURM
    does not list it); nothing to cancel', though it may be running: SLURM never answered.
    (SLURM_CONF names no file: squeue and scontrol fail, as they do where SLURM is down.)"""
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    run.event("start", step=0, job_id="4242")
    done = pyrecover("cancel", str(run.root), env={"SLURM_CONF": str(tmp_path / "none.conf")})
    assert done.returncode == 1, done.stderr  # a fault of the cluster: 2 is a user's mistake
    said = done.stderr.splitlines()
    assert said[-1].startswith("error: ") and "did not answer" in said[-1], said
    assert "nothing to cancel" not in done.stderr


def test_a_data_mistake_on_an_existing_run_is_one_line_and_recorded_as_its_error(tmp_path):
    """As the README says: nothing is written but the `error` event the job script reads."""
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "store" / "exp")
    run.create()
    run.event("start", step=0)
    before = files_under(run.root)
    done = pyrecover("train", "--config", str(TINY), "--run-dir", str(run.root),
                     "--set", "data.path=no-such.parquet", cwd=tmp_path)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert files_under(run.root) == before
    last = run.events.read_text().splitlines()[-1]
    assert '"event": "error"' in last and "no-such.parquet" in last
    status = pyrecover("status", str(run.root))
    assert "state       error" in status.stdout and "no-such.parquet" in status.stdout
