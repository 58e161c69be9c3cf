"""Bad input: one line saying what is wrong, exit code 2, and nothing written anywhere."""

from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TINY, pyrecover, tiny_args


def files_under(path):
    return sorted(p.relative_to(path) for p in path.rglob("*"))


@pytest.mark.parametrize("args, message", [
    (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
    (["--config", str(TINY), "--set", "train.nope=1"],
     "error: --set train.nope: unknown key 'train.nope'"),
    (["--config", str(TINY), "--set", "run.exp_name=../../etc"], "run.exp_name='../../etc'"),
    (["--config", str(TINY), "--set", "run.exp_name=a/b"], "run.exp_name='a/b'"),
    (["--config", str(TINY), "--set", "run.exp_name=.."], "run.exp_name='..'"),
    (["--config", str(TINY), "--set", "data.path=no-such.parquet"],
     "data file 'no-such.parquet' does not exist"),
    (["--config", str(TINY), "--set", "data.path=wrong.parquet"],
     "wrong.parquet: no column 'text' (data.column); it has: body"),
    (["--config", str(TINY), "--nproc", "3"], "train.global_batch_size=8 is not allowed"),
    (["--config", "."], "config file '.' is a folder, not a YAML file"),
    (["--config", str(TINY), "--set", "data.path=."],
     "data file '.' is a folder, not a parquet file"),
    (["--config", str(TINY), "--set", "run.exp_name=" + "a" * 129],
     "(129 characters) is not allowed"),  # the name's length, not its quoted repr's
    (["--config", "/dev/null"],
     "config file '/dev/null' is not a regular file (a FIFO, a device or a socket)"),
    (["--config", str(TINY), "--set", "data.path=/dev/null"],
     "data file '/dev/null' is not a regular file"),
    (["--config", str(TINY), "--set", "train.lr=-1"],
     "train.lr=-1.0 is not allowed: expected a learning rate > 0"),  # not min_lr's fault
    (["--config", str(TINY), "--set", "tracking.tags=[a,b]"],
     "tracking.tags='[a,b]' is not allowed: expected tags separated by commas"),
])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, args, message):
    pq.write_table(pa.table({"body": ["some text"]}), tmp_path / "wrong.parquet")
    before = files_under(tmp_path)
    done = pyrecover("train", *args, "--set", f"run.storage={tmp_path / 'store'}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert "Traceback" not in done.stderr
    assert files_under(tmp_path) == before
    if "--set" in message:  # a --set mistake is not blamed on the (valid) config file
        assert str(TINY) not in lines[0]


@pytest.mark.parametrize("args, said, help_of", [
    (["train", "--nproc", "0"],
     "Invalid value for '--nproc': Input should be greater than or equal to 1", "train"),
    (["train", "--bogus"], "No such option: --bogus", "train"),
    (["ckpt", "ls"], "Missing argument 'run_dir'", "ckpt ls"),
    (["nosuchcommand"], "No such command 'nosuchcommand'", ""),
])
def test_a_command_line_mistake_is_one_line_naming_the_help_to_read(tmp_path, args, said,
                                                                    help_of):
    done = pyrecover(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    command = f"{help_of} --help" if help_of else "--help"
    assert lines in ([f"error: {said} (see `{prog} {command}`)"]
                     for prog in ("pyrecover", "python -m pyrecover")), done.stderr
    assert files_under(tmp_path) == []


def test_a_group_without_its_command_shows_its_help_and_help_exits_0(tmp_path):
    done = pyrecover("data", cwd=tmp_path)
    assert done.returncode == 2 and "pyrecover data [OPTIONS] COMMAND" in done.stderr
    assert "prepare  Build a parquet corpus" in done.stderr
    done = pyrecover("train", "--help", cwd=tmp_path)
    assert done.returncode == 0 and "pyrecover train [OPTIONS]" in done.stdout.splitlines()[0]


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


def test_data_prepare_without_sources_is_a_clear_error(tmp_path):
    done = pyrecover("data", "prepare", str(tmp_path / "none"), str(tmp_path / "o.parquet"))
    assert done.returncode == 2
    assert "source folder" in done.stderr and "does not exist" in done.stderr


def test_data_prepare_from_an_empty_source_is_refused_not_the_current_folder(tmp_path):
    """`data prepare "$TEXTS" c.parquet` with the variable unset built a corpus of whatever
    the current folder held (as a Path, "" is "."), and trained on it without a word."""
    (tmp_path / "secret.py").write_text("password = 'x'\n")
    done = pyrecover("data", "prepare", "", "c.parquet", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: SRC_DIR is empty; give the folder of text files to read, e.g. ~/my-texts"]
    assert not (tmp_path / "c.parquet").exists()


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


def test_data_prepare_into_a_folder_or_an_unwritable_place_is_one_line_and_leaves_nothing(
        tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("print('hi')\n")
    for out, said in ((src, "is a folder; give the parquet file to write"),
                      (tmp_path / "not-a-dir" / "x" / "c.parquet", "is a file, not a folder")):
        if out != src:
            (tmp_path / "not-a-dir").write_text("a file where a folder should be")
        done = pyrecover("data", "prepare", str(src), str(out))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and said in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_data_prepare_under_a_file_says_so_not_that_the_file_exists(tmp_path):
    """`data prepare texts notes.txt/c.parquet` read every file, then said 'cannot write
    notes.txt/c.parquet: File exists' (mkdir's words for the parent that is a file)."""
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("print('hi')\n")
    (tmp_path / "notes.txt").write_text("a file where a folder should be")
    out = tmp_path / "notes.txt" / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {out}: {tmp_path / 'notes.txt'} is a file, not a folder; choose a path under "
        "a folder"]


def test_data_prepare_on_a_full_disk_is_a_storage_fault_that_keeps_the_old_corpus(tmp_path):
    """A full disk is no mistake of the user's: exit 1 with a `storage:` line, as export and
    plot say it (it was exit 2), and the corpus already there stays whole."""
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text(os.urandom(50_000).hex())  # text no compression makes small
    out = tmp_path / "c.parquet"
    out.write_bytes(b"the old corpus")
    done = pyrecover("data", "prepare", str(src), str(out), "--force", max_file_bytes=4096)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: storage: cannot write {out}: "), done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert out.read_bytes() == b"the old corpus"
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_data_prepare_into_a_name_that_is_no_parquet_file_is_refused_before_reading(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("print('hi')\n")
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "corpus.txt"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {tmp_path / 'corpus.txt'} does not end in .parquet, and the corpus is written "
        f"as parquet; name it e.g. {tmp_path / 'corpus.parquet'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


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


def test_data_prepare_takes_a_suffix_with_or_without_its_dot(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    (src / "b.md").write_text("# hi\n")
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "c.parquet"),
                     "--suffix", "txt", "--suffix", ".md")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "c.parquet")["path"].to_pylist() == ["a.txt", "b.md"]


def test_data_prepare_replaces_an_existing_corpus_only_with_force(tmp_path):
    """A run trained on the old file would resume on the new one without a word."""
    src, out = tmp_path / "texts", tmp_path / "c.parquet"
    src.mkdir()
    (src / "a.py").write_text("print('new')\n")
    out.write_bytes(b"the old corpus")
    done = pyrecover("data", "prepare", str(src), str(out))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "already exists; pass --force" in done.stderr
    assert out.read_bytes() == b"the old corpus"
    done = pyrecover("data", "prepare", str(src), str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(out)["text"].to_pylist() == ["print('new')\n"]


def test_a_limit_smaller_than_the_first_file_says_so(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n" * 400)
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "c.parquet"), "--max-mb",
                     "0.001")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "a.py (0.002 MB of text), is larger than the limit of 0.001 MB" in done.stderr


def test_a_run_this_user_may_not_read_is_one_line_and_exit_2_never_a_traceback(tmp_path,
                                                                              corpus):
    """A colleague's run, or one chmod'ed by accident: status, plot, ckpt and a resume each
    say which path and exit 2 (the job script does not requeue what no retry fixes); with
    --nproc 2 every rank ends at once, none waiting for a rank 0 that is gone, and none
    saying rank 0 died."""
    run = tmp_path / "theirs"
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=2"))
    assert done.returncode == 0, done.stderr
    resume = ["train", "--nproc", "2", *tiny_args(tmp_path, corpus, "theirs",
                                                   "train.max_steps=4", "train.device=cpu")]
    for locked in (run / "events.jsonl", run / "checkpoints"):
        mode = locked.stat().st_mode
        locked.chmod(0)
        try:
            readers = [["status", str(run)], resume] + (  # plot reads no checkpoint, and
                [["plot", str(run), "--out", str(tmp_path / "run.png")]]  # ckpt ls no event
                if locked.name == "events.jsonl" else [["ckpt", "ls", str(run)]])
            for args in readers:
                done = pyrecover(*args, file_permissions=True)
                assert done.returncode == 2, (args, done.stderr)
                assert f"error: permission denied: {locked}; give this user access to it" in \
                    done.stderr, (args, done.stderr)
                assert "Traceback" not in done.stderr and "TCPStore" not in done.stderr, \
                    done.stderr
                if args is resume and locked.name == "events.jsonl":  # rank 1 was in the loop
                    assert "rank 1: stopped because rank 0 stopped on an error" in done.stderr
                    assert "died" not in done.stderr, done.stderr  # (no resume helps)
                    assert "pyrecover: rank 1 " not in done.stderr  # not named as a cause
        finally:
            locked.chmod(mode)


def test_exporting_into_a_folder_this_user_may_not_write_is_a_permission_error_exit_2(
        tmp_path, corpus):
    """Into a read-only folder, export and convert said `storage: cannot write` and exit 1, a
    fault a retry may mend, where a missing folder under it was exit 2 `permission denied`."""
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "mine", "train.max_steps=1"))
    assert done.returncode == 0, done.stderr
    shut = tmp_path / "shut"
    shut.mkdir(0o555)
    for args in (["export", "--out", str(shut / "m.pt")],
                 ["export", "--out", str(shut / "m.safetensors")],
                 ["export", "--format", "hf", "--out", str(shut / "hf")],
                 ["convert", "--to", "torch", str(shut / "s.pt")]):
        done = pyrecover("ckpt", args[0], str(tmp_path / "mine"), *args[1:],
                         file_permissions=True)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr == (f"error: permission denied: {shut}; give this user access to "
                               "it (or run as its owner)\n"), (args, done.stderr)
    assert files_under(shut) == []


def test_a_checkpoints_folder_this_user_may_read_but_not_write_stops_the_start(tmp_path,
                                                                               corpus):
    """checkpoints/ readable but not writable (chmod 555, another user's copy): the resume
    read it, trained to the end with every save refused and failed at the final save. The
    health check's write now meets it first: one line naming the folder, exit 2."""
    run = tmp_path / "theirs"
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=2"))
    assert done.returncode == 0, done.stderr
    rows = (run / "metrics.jsonl").read_text()
    (run / "checkpoints").chmod(0o555)
    try:
        again = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=4"),
                          file_permissions=True)
    finally:
        (run / "checkpoints").chmod(0o755)
    assert again.returncode == 2, again.stderr
    assert again.stderr.strip().splitlines()[-1] == (
        f"error: permission denied: {run / 'checkpoints'}; give this user access to it (or "
        "run as its owner)"), again.stderr
    assert (run / "metrics.jsonl").read_text() == rows  # nothing trained


@pytest.mark.parametrize("text, said", [
    ("train:\n  max_steps: 2\x00\n", "not valid YAML (character U+0000 at offset 21, which "
                                     "YAML forbids)"),
    ("train:\n  max_steps: " + "9" * 5000 + "\n", "holds a number of more than 4300 digits"),
    ("train:\n  lr: " + "[" * 5000 + "\n", "not valid YAML (nested too deeply)"),
])
@pytest.mark.parametrize("command", ["train", "launch", "sweep"])
def test_yaml_that_parses_badly_in_other_ways_is_one_line_for_every_kind_of_file(
        tmp_path, text, said, command):
    """A NUL byte, a 5000-digit number, 5000 nested brackets: PyYAML's reader, Python's int
    limit and the recursion limit each ended a config, cluster profile or sweep in a
    traceback."""
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    args = {"train": ["train", "--config", str(path)],
            "launch": ["launch", "--cluster", str(path), "--dry-run"],
            "sweep": ["sweep", "launch", str(path), "--dry-run"]}[command]
    done = pyrecover(*args, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {path}"), line
    # (A cluster profile reads its values as the strings written: the number is no problem
    # there, its key is.)
    assert said in line or (command == "launch" and "digits" in said), line


@pytest.mark.parametrize("value, said", [
    ("9" * 5000, "a number of 5000 characters is no config value"),
    ("[" * 5000, "is not allowed: expected a number"),
])
def test_a_set_value_python_cannot_read_is_one_line(value, said):
    done = pyrecover("train", "--set", f"train.lr={value}")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert said in done.stderr


@pytest.mark.parametrize("args", [
    ["bench", "ckpt", "--size-gb", "nan"], ["bench", "memory", "--size-gb", "inf"],
    ["bench", "restart", "--local", "--state-gb", "nan"],
    ["bench", "gpu-check", "--budget", "inf"],
])
def test_a_float_option_that_is_no_finite_number_is_one_line(tmp_path, args):
    done = pyrecover(*args[:2], "--dir", str(tmp_path / "d"), *args[2:]) if args[1] != \
        "gpu-check" else pyrecover(*args)
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert "is not a finite number" in line, line
    assert not (tmp_path / "d").exists()


def test_an_os_error_without_a_path_keeps_its_message():
    from pyrecover.cli.app import os_error_line

    assert os_error_line(OSError("boom")) == "OSError (boom)"
    assert os_error_line(BrokenPipeError(32, "Broken pipe")) == (
        "Broken pipe ([Errno 32] Broken pipe)")
    assert os_error_line(PermissionError(13, "Permission denied", "/x/y")) == (
        "permission denied: /x/y; give this user access to it (or run as its owner)")
    assert os_error_line(OSError(5, "Input/output error", "/x/y")) == "/x/y: Input/output error"


def test_a_yaml_value_its_constructor_refuses_is_not_called_a_long_number(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  max_steps: 2024-13-45\n")
    done = pyrecover("train", "--config", str(path))
    assert done.returncode == 2 and "not valid YAML" in done.stderr, done.stderr
    assert "digits" not in done.stderr


def test_one_step_folder_this_user_may_not_read_is_one_invalid_row_not_the_end_of_ls(
        tmp_path, corpus):
    """A chmod 000 step folder (a colleague's copy, a half-restored backup): `ckpt ls` and
    `verify` ended at its manifest with "permission denied", exit 2, hiding the checkpoints
    that are fine, while export and a resume skip it and use the next one."""
    run = tmp_path / "theirs"
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "theirs", "train.max_steps=2",
                                         "checkpoint.interval=1"))
    assert done.returncode == 0, done.stderr
    locked = run / "checkpoints" / "step-2"
    locked.chmod(0)
    try:
        listed = pyrecover("ckpt", "ls", str(run), file_permissions=True)
        fast = pyrecover("ckpt", "ls", str(run), "--fast", file_permissions=True)
        verified = pyrecover("ckpt", "verify", str(run), file_permissions=True)
    finally:
        locked.chmod(0o755)
    for done in (listed, fast):
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
        rows = done.stdout.splitlines()[1:]
        assert rows[0].split()[0] == "2" and "INVALID: " in rows[0], done.stdout
        assert "Permission denied" in rows[0], done.stdout
        assert rows[1].split()[0] == "1" and "ok" in rows[1], done.stdout
    assert verified.returncode == 1 and "Traceback" not in verified.stderr, verified.stderr
    assert verified.stdout.splitlines()[1] == "step 1: ok", verified.stdout
    assert verified.stdout.startswith("step 2: INVALID: "), verified.stdout
