"""Build the real image from containers/pyrecover.def and run it: needs a real apptainer.

Skips with the reason where there is none (tests/bin/apptainer is a bubblewrap stand-in for
`apptainer exec` only, and cannot build). The build pulls the base image (a few GB) and
pip-installs the project, so it needs network access and takes minutes; it also runs the
definition's %test, which reports CUDA and NCCL and passes without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pyrecover import container

pytestmark = pytest.mark.apptainer

REPO = Path(__file__).resolve().parents[2]
DEF = REPO / "containers" / "pyrecover.def"
BUILD_TIMEOUT = 3600


def real_apptainer() -> tuple[str | None, str]:
    """The path of a real apptainer (or singularity), or None and why not."""
    exe = container.find_apptainer()
    if exe is None:
        return None, "apptainer is not installed (neither apptainer nor singularity on PATH)"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    if "stand-in" in version.stdout:
        return None, f"{exe} is the bubblewrap stand-in from tests/bin; it cannot build images"
    return exe, ""


@pytest.fixture(scope="module")
def apptainer() -> str:
    exe, reason = real_apptainer()
    if exe is None:
        pytest.skip(reason)
    return exe


@pytest.fixture(scope="module")
def sif(apptainer, tmp_path_factory) -> Path:
    """The image, built once by `pyrecover image build` (which runs its %test too)."""
    out = tmp_path_factory.mktemp("image") / "pyrecover.sif"
    done = subprocess.run([sys.executable, "-m", "pyrecover", "image", "build", str(DEF),
                           str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=BUILD_TIMEOUT)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert out.is_file()
    return out


def test_the_image_builds_and_its_test_section_passes(apptainer, sif):
    done = subprocess.run([apptainer, "test", str(sif)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    assert "pyrecover image OK" in done.stdout
    assert "NCCL backend: True" in done.stdout


def test_the_runscript_passes_its_arguments_to_the_cli(apptainer, sif):
    done = subprocess.run([apptainer, "run", str(sif), "image", "--help"], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "Check and build the Apptainer image." in done.stdout


def test_exec_argv_runs_the_installed_package_inside_the_image(apptainer, sif, tmp_path):
    code = ("import pyrecover, torch; open('/pyrecover-out/where', 'w')"
            ".write(pyrecover.__file__ + ' ' + str(torch.version.cuda))")
    argv = container.exec_argv(sif, ["python", "-c", code], [f"{tmp_path}:/pyrecover-out"],
                               nv=False, pwd="/", apptainer=apptainer)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    where, cuda = (tmp_path / "where").read_text().split()
    assert "site-packages" in where  # installed, not the bind-mounted checkout
    assert cuda != "None"  # the base image's CUDA build of torch is still there
