"""tests/bin/apptainer, the stand-in for the apptainer CLI (which cannot be installed here),
behaves like `apptainer exec` where pyrecover relies on it: binds, exit codes, signals."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import is_running

STANDIN = Path(__file__).resolve().parents[1] / "bin" / "apptainer"
TIMEOUT = 20

# A python child that reports each SIGUSR2/SIGTERM it gets, says when it is ready, and
# exits 7 half a second after the first signal (long enough to see a duplicate).
TRAPPER = """
import os, signal, sys, time
ready, got = sys.argv[1], []
def handler(signum, frame):
    got.append(signum)
    print("got", signal.Signals(signum).name, flush=True)
signal.signal(signal.SIGUSR2, handler)
signal.signal(signal.SIGTERM, handler)
with open(ready, "w") as f:
    f.write(str(os.getpid()))
deadline = time.monotonic() + 15
while time.monotonic() < deadline and not got:
    time.sleep(0.02)
time.sleep(0.5)
sys.exit(7 if got else 1)
"""


@pytest.fixture(autouse=True)
def bwrap_available():
    if shutil.which("bwrap") is None:
        reason = "the apptainer stand-in needs bwrap (Debian package bubblewrap)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)


@pytest.fixture
def image(tmp_path: Path) -> Path:
    """An image file: the stand-in checks that it exists and ignores what is in it."""
    path = tmp_path / "image.sif"
    path.write_bytes(b"not really a SIF")
    return path


def apptainer(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(STANDIN), *args], capture_output=True, text=True, timeout=TIMEOUT, **kwargs
    )


def start_trapper(image: Path, tmp_path: Path, **popen_kwargs) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [str(STANDIN), "exec", str(image), sys.executable, "-c", TRAPPER, str(ready)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **popen_kwargs,
    )
    deadline = time.monotonic() + TIMEOUT
    while not (ready.exists() and ready.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the trapping child never became ready"
        time.sleep(0.02)
    return proc, ready


def test_version_says_it_is_the_standin_not_apptainer():
    out = apptainer("--version")

    assert out.returncode == 0
    assert out.stdout.startswith("apptainer version ")
    assert "stand-in" in out.stdout


def test_a_bind_to_another_path_is_visible_inside_and_writes_land_in_the_source(image, tmp_path):
    src = tmp_path / "storage"
    src.mkdir()
    (src / "before.txt").write_text("from the host")
    dst = "/pyrecover-test-ckpt"  # a new top-level path: must not appear on the host

    out = apptainer(
        "exec",
        "--nv",
        "--bind",
        f"{src}:{dst}",
        str(image),
        "sh",
        "-c",
        f"cat {dst}/before.txt && echo written > {dst}/inside.txt",
    )

    assert out.returncode == 0, out.stderr
    assert out.stdout == "from the host"
    assert (src / "inside.txt").read_text() == "written\n"
    assert not Path(dst).exists()


def test_several_binds_with_b_and_a_comma_list_and_read_only(image, tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    for d in (a, b, c):
        d.mkdir()
        (d / "name").write_text(d.name)

    out = apptainer(
        "exec",
        "-B",
        f"{a}:/standin-a,{b}:/standin-b",
        "--bind",
        f"{c}:/standin-c:ro",
        str(image),
        "sh",
        "-c",
        "cat /standin-a/name /standin-b/name /standin-c/name; touch /standin-c/x",
    )

    assert out.stdout == "abc"
    assert out.returncode != 0  # the read-only bind refused the write
    assert not (c / "x").exists()


@pytest.mark.parametrize("code", [0, 3, 42])
def test_the_commands_exit_code_is_the_exit_code(image, code):
    assert apptainer("exec", str(image), "sh", "-c", f"exit {code}").returncode == code


def test_a_missing_image_or_an_unknown_option_fails_with_255(image, tmp_path):
    missing = apptainer("exec", str(tmp_path / "missing.sif"), "true")
    unknown = apptainer("exec", "--writable", str(image), "true")

    assert (missing.returncode, unknown.returncode) == (255, 255)
    assert "missing.sif" in missing.stderr
    assert "--writable" in unknown.stderr


def test_env_options_reach_the_command_and_cleanenv_drops_the_host_environment(image):
    host_env = {**os.environ, "FROM_HOST": "yes", "SLURM_PROCID": "3"}
    script = 'echo "$FROM_HOST|$SLURM_PROCID|$A|$B|$APPTAINER_NAME"'

    kept = apptainer("exec", "--env", "A=1,B=2", str(image), "sh", "-c", script, env=host_env)
    clean = apptainer(
        "exec", "--cleanenv", "--env", "A=1", str(image), "sh", "-c", script, env=host_env
    )

    assert kept.stdout == "yes|3|1|2|image.sif\n"
    assert clean.stdout == "||1||image.sif\n"


def test_sigusr2_sent_to_the_standins_pid_reaches_a_python_child_that_traps_it(image, tmp_path):
    proc, _ = start_trapper(image, tmp_path)

    os.kill(proc.pid, signal.SIGUSR2)
    out, err = proc.communicate(timeout=TIMEOUT)

    assert proc.returncode == 7, err
    assert out == "got SIGUSR2\n"


def test_a_signal_to_the_standins_process_group_reaches_the_command_exactly_once(image, tmp_path):
    # SLURM's proctrack/pgid signals a task's whole process group; bwrap itself must not
    # get it (it would die and take the command with it), and the command not twice.
    proc, _ = start_trapper(image, tmp_path, start_new_session=True)

    os.killpg(proc.pid, signal.SIGTERM)
    out, err = proc.communicate(timeout=TIMEOUT)

    assert proc.returncode == 7, err
    assert out == "got SIGTERM\n"


def test_killing_the_standin_takes_the_command_down_with_it(image, tmp_path):
    proc, ready = start_trapper(image, tmp_path)
    child = int(ready.read_text())

    proc.kill()
    proc.wait(timeout=TIMEOUT)

    deadline = time.monotonic() + 5
    while is_running(child):
        assert time.monotonic() < deadline, f"the command {child} outlived the stand-in"
        time.sleep(0.02)
