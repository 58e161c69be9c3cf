"""Bad input on the command line or in a config: one line saying what is wrong, exit code 2,
and nothing written anywhere."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TINY, files_under, pyrecover


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
