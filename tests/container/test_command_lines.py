"""The apptainer command lines pyrecover builds (build, exec, binds): every option before
the image, every hostile word one argument, and binds and environment that work in the
stand-in apptainer (tests/bin/apptainer, bubblewrap) where no real one exists."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pyrecover import container
from pyrecover.container import Bind, ContainerError, exec_argv, parse_bind

REPO = Path(__file__).resolve().parents[2]
STANDIN_DIR = REPO / "tests" / "bin"  # holds a stand-in `apptainer` that cannot build


def test_build_argv_uses_fakeroot_only_when_asked():
    assert container.build_argv("a.def", "a.sif", fakeroot=False) == [
        "apptainer", "build", "a.sif", "a.def"]
    assert container.build_argv(Path("c/a.def"), "a.sif", fakeroot=True, force=True,
                                apptainer="/usr/bin/singularity") == [
        "/usr/bin/singularity", "build", "--fakeroot", "--force", "a.sif", "c/a.def"]


def test_find_apptainer_finds_apptainer_then_singularity(tmp_path):
    for name in ("singularity", "apptainer"):
        exe = tmp_path / name
        exe.write_text("#!/bin/sh\n")
        exe.chmod(0o755)
        assert container.find_apptainer(str(tmp_path)) == str(exe)
    assert container.find_apptainer(str(tmp_path / "empty")) is None


def test_exec_argv_puts_options_before_the_image_and_the_command_last():
    argv = exec_argv("/images/py recover.sif", ["pyrecover", "train", "--set", "run.exp_name=a"],
                     ["/scratch/runs:/runs", Bind("/data", "/data", read_only=True), "/tmp"],
                     env={"WANDB_MODE": "offline", "CUDA_VISIBLE_DEVICES": "0,1"}, pwd="/runs")
    assert argv == [
        "apptainer", "exec", "--nv", "--pwd", "/runs",
        "--bind", "/scratch/runs:/runs", "--bind", "/data:/data:ro", "--bind", "/tmp",
        "--env", "CUDA_VISIBLE_DEVICES=0,1", "--env", "WANDB_MODE=offline",
        "/images/py recover.sif", "pyrecover", "train", "--set", "run.exp_name=a"]


def test_exec_argv_without_nv_and_with_cleanenv():
    assert exec_argv("i.sif", ["true"], nv=False, cleanenv=True, apptainer="singularity") == [
        "singularity", "exec", "--cleanenv", "i.sif", "true"]


HOSTILE = ["name with spaces", "it's", 'say "hi"', "a;b", "$(rm -rf /)", "`id`", "line\nbreak",
           "*", "--bind", ""]


@pytest.mark.parametrize("word", HOSTILE)
def test_exec_argv_keeps_each_hostile_word_one_argument_through_a_shell(word):
    argv = exec_argv(f"/img/{word}.sif", ["echo", word], [f"/scratch/{word or 'x'}:/runs"])
    assert argv[-3:] == [f"/img/{word}.sif", "echo", word]
    assert shlex.split(shlex.join(argv)) == argv
    out = subprocess.run(["sh", "-c", "printf '%s\\0' " + shlex.join(argv[-1:])],
                         capture_output=True, text=True, check=True).stdout
    assert out == word + "\0"


def test_exec_argv_binds_and_env_work_in_the_apptainer_standin(tmp_path):
    # tests/bin/apptainer stands in for `apptainer exec` (bubblewrap); the image is ignored.
    if not any(Path(d, "bwrap").exists() for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("bwrap (Debian package bubblewrap) is not installed; the stand-in needs it")
    (tmp_path / "runs").mkdir()
    image = tmp_path / "image.sif"
    image.write_text("not a real image\n")
    script = "import os; open('/pyrecover-runs/seen', 'w').write(os.environ['GREETING'])"
    argv = exec_argv(image, [sys.executable, "-c", script],
                     [f"{tmp_path / 'runs'}:/pyrecover-runs"], env={"GREETING": "hello, world"},
                     apptainer=str(STANDIN_DIR / "apptainer"))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs" / "seen").read_text() == "hello, world"


def test_exec_argv_needs_a_command():
    with pytest.raises(ContainerError, match="needs a command"):
        exec_argv("i.sif", [])


@pytest.mark.parametrize(("key", "value", "match"), [
    ("1BAD", "x", "name '1BAD'"),
    ("A-B", "x", "name 'A-B'"),
    ("A", "x=1,y=2", "both '=' and ','"),
    ("A", 'say "hi"', "cannot carry"),
    ("A", "two\nlines", "cannot carry"),
])
def test_exec_argv_refuses_variables_apptainer_would_misread(key, value, match):
    with pytest.raises(ContainerError, match=match):
        exec_argv("i.sif", ["true"], env={key: value})


@pytest.mark.parametrize(("text", "bind"), [
    ("/scratch/runs", Bind("/scratch/runs")),
    ("/scratch/runs:/runs", Bind("/scratch/runs", "/runs")),
    ("/data:/data:ro", Bind("/data", "/data", read_only=True)),
    ("/data:/in:rw", Bind("/data", "/in")),
    ("relative/dir:/work", Bind("relative/dir", "/work")),
    ("/with space:/in space", Bind("/with space", "/in space")),
])
def test_parse_bind_reads_src_dst_and_options(text, bind):
    assert parse_bind(text) == bind
    assert parse_bind(bind.spec()) == bind


@pytest.mark.parametrize(("text", "match"), [
    ("", "empty bind"),
    ("   ", "empty bind"),
    (":/runs", "the source \\(host\\) path is empty"),
    ("/a:", "the destination is empty"),
    ("/a:runs", "destination 'runs' must be an absolute path"),
    ("/a:ro", "for a read-only bind write /a:/a:ro"),
    ("/a:/b:rx", "the option must be 'ro' or 'rw', got 'rx'"),
    ("/a:/b:ro:x", "got 4 ':'-separated fields"),
    ("/a,/b", "',' separates binds"),
])
def test_parse_bind_errors_name_the_bad_bind_and_what_is_expected(text, match):
    with pytest.raises(ContainerError, match=match):
        parse_bind(text)


def test_container_module_imports_neither_torch_nor_spython_nor_the_project():
    code = ("import sys; import pyrecover.container; "
            "bad = [m for m in ('torch', 'spython', 'pyrecover.config', 'pyrecover.cli') "
            "if m in sys.modules]; print(bad)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True)
    assert done.stdout.strip() == "[]"
