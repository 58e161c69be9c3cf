"""The Apptainer definition: containers/pyrecover.def passes its checks, broken copies fail
at the right line, and the `pyrecover image` commands behave (the apptainer command lines
themselves: test_command_lines.py).

spython is the real parser throughout. Nothing here needs apptainer; building the image is
tests/container/test_image.py, which skips where no real apptainer exists.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from pyrecover import container
from pyrecover.cli import app
from pyrecover.container import (
    ContainerError,
    check_definition,
    definition,
)

REPO = Path(__file__).resolve().parents[2]
DEF = REPO / "containers" / "pyrecover.def"
STANDIN_DIR = REPO / "tests" / "bin"  # holds a stand-in `apptainer` that cannot build


def real_text() -> str:
    return DEF.read_text()


def line_of(text: str, startswith: str) -> int:
    """The 1-based number of the first line that starts with `startswith` (after indent)."""
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip().startswith(startswith):
            return number
    raise AssertionError(f"no line starts with {startswith!r}")


def without_section(text: str, name: str) -> str:
    """The text with section %name removed, up to the next section."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("%"):
            skipping = line.split()[0] == f"%{name}"
        if not skipping:
            kept.append(line)
    return "\n".join(kept) + "\n"


def broken(tmp_path: Path, text: str) -> list[container.Problem]:
    path = tmp_path / "broken.def"
    path.write_text(text)
    return check_definition(path, root=REPO)


def only(problems: list[container.Problem]) -> container.Problem:
    assert len(problems) == 1, problems
    return problems[0]


# --- the real definition -------------------------------------------------------------------


def test_the_real_definition_passes_every_check():
    assert check_definition(DEF, root=REPO) == []


def test_the_real_definition_copies_in_what_make_gpu_test_needs():
    text = real_text()
    for source in ("pyproject.toml", "README.md", "pyrecover", "launch", "tests"):
        assert any(line.split()[:1] == [source] for line in text.splitlines()), source


def test_spython_reads_the_real_definition_as_written():
    recipes, error, _ = definition._spython_parse(real_text())
    assert error is None
    recipe = list(recipes.values())[-1]
    assert recipe.fromHeader == "pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime"
    assert recipe.cmd == 'exec pyrecover "$@"'
    assert recipe.test is not None
    assert "pyrecover /opt/pyrecover/pyrecover" in recipe.files


def test_the_images_environment_keeps_the_hosts_python_packages_out(tmp_path):
    """apptainer passes the host's environment in and binds $HOME: the %environment section,
    run by a real shell over a host environment that points elsewhere, leaves Python neither
    the user's ~/.local site-packages nor the host's PYTHONPATH (a `pip install --user torch`
    would shadow the image's CUDA torch)."""
    section = without_section(real_text(), "post")
    body = section.split("%environment", 1)[1].split("\n%", 1)[0]
    shadow = tmp_path / "shadow"
    (shadow / "torch").mkdir(parents=True)
    probe = "import sys; print(sys.flags.no_user_site, any('shadow' in p for p in sys.path))"
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "PYTHONPATH": str(shadow)}
    done = subprocess.run(["bash", "-c", f"{body}\n{shlex.quote(sys.executable)} -c "
                           f"{shlex.quote(probe)}"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "False"]


# --- broken copies -------------------------------------------------------------------------


def test_a_definition_without_a_from_header_fails_at_its_bootstrap_line(tmp_path):
    text = real_text()
    lines = [line for line in text.splitlines() if not line.startswith("From:")]
    problem = only(broken(tmp_path, "\n".join(lines) + "\n"))
    assert problem.line == line_of(text, "Bootstrap:")
    assert "needs a 'From:' header" in problem.message


def test_a_definition_without_a_bootstrap_header_fails_where_the_header_belongs(tmp_path):
    text = real_text().replace("Bootstrap: docker\n", "")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "From:")
    assert "no 'Bootstrap:' header" in problem.message


def test_a_post_without_the_install_step_fails_at_the_post_header(tmp_path):
    text = "\n".join(line for line in real_text().splitlines() if "pip install" not in line)
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "%post")
    assert "does not pip-install the project copied to /opt/pyrecover" in problem.message


def test_an_install_that_could_replace_torch_fails_at_the_pip_line(tmp_path):
    text = real_text().replace("--constraint /tmp/torch-pin.txt ", "")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "python -m pip install")
    assert "may replace the base image's CUDA torch" in problem.message


@pytest.mark.parametrize("pinning", ["--no-deps", "--constraint=/tmp/c.txt", "-c /tmp/c.txt"])
def test_an_install_with_no_deps_or_a_constraint_passes(tmp_path, pinning):
    text = real_text().replace("--constraint /tmp/torch-pin.txt", pinning)
    assert broken(tmp_path, text) == []


def test_an_install_through_a_variable_or_after_cd_is_recognised(tmp_path):
    via_variable = real_text().replace(
        "    set -eu\n", "    set -eu\n    PROJECT=/opt/pyrecover\n").replace(
        "/opt/pyrecover pytest", '"$PROJECT" pytest')
    after_cd = real_text().replace(
        "    set -eu\n", "    set -eu\n    cd /opt/pyrecover\n").replace(
        "/opt/pyrecover pytest", ". pytest")
    assert broken(tmp_path, via_variable) == []
    assert broken(tmp_path, after_cd) == []


def test_installing_pyrecover_from_pypi_is_not_installing_the_project(tmp_path):
    text = real_text().replace("/opt/pyrecover pytest", "pyrecover pytest")
    assert "does not pip-install the project" in only(broken(tmp_path, text)).message


def test_a_definition_without_a_runscript_fails_naming_the_section(tmp_path):
    text = without_section(real_text(), "runscript")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "Bootstrap:")
    assert problem.message.startswith("no %runscript section")


def test_a_runscript_that_drops_its_arguments_fails_at_its_header(tmp_path):
    text = real_text().replace('exec pyrecover "$@"', "exec pyrecover")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "%runscript")
    assert '"$@"' in problem.message


def test_a_definition_without_a_test_section_fails_naming_the_section(tmp_path):
    text = without_section(real_text(), "test")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "Bootstrap:")
    assert problem.message.startswith("no %test section")


def test_files_that_leave_out_the_package_fail_at_the_files_header(tmp_path):
    text = "\n".join(line for line in real_text().splitlines()
                     if line.strip() != "pyrecover /opt/pyrecover/pyrecover")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "%files")
    assert "does not copy pyrecover" in problem.message


def test_files_that_scatter_the_project_fail_at_the_stray_entry(tmp_path):
    text = real_text().replace("pyrecover /opt/pyrecover/pyrecover", "pyrecover /srv/pyrecover")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "pyrecover /srv/pyrecover")
    assert "pyrecover lands in /srv, pyproject.toml in /opt/pyrecover" in problem.message
    assert "pip install needs them in one folder" in problem.message


def test_a_files_source_missing_from_the_build_directory_fails_at_its_line(tmp_path):
    text = real_text().replace("launch /opt/pyrecover/launch", "launchers /opt/pyrecover/launch")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "launchers")
    assert "'launchers' does not exist" in problem.message


def test_a_non_docker_bootstrap_fails_at_its_line(tmp_path):
    text = real_text().replace("Bootstrap: docker", "Bootstrap: localimage")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "Bootstrap:")
    assert "Bootstrap: localimage" in problem.message


def test_a_comment_saying_bootstrap_breaks_spython_and_is_named(tmp_path):
    text = "# bootstraps the trainer image\n" + real_text()
    problem = only(broken(tmp_path, text))
    assert problem.line == 1
    assert "spython reads this line as a 'Bootstrap:' header" in problem.message


def test_a_comment_with_from_colon_that_spython_takes_as_the_base_image_is_named(tmp_path):
    text = real_text().replace("\n%files\n", "\n# copied from: the NGC docs\n%files\n")
    problem = only(broken(tmp_path, text))
    assert problem.line == line_of(text, "# copied from:")
    assert "spython reads the base image as ''" in problem.message


def test_a_section_whose_first_line_spython_misreads_is_named(tmp_path):
    runscript = '    exec pyrecover "$@"'
    text = real_text().replace(runscript, "    echo from: x\n" + runscript)
    problems = broken(tmp_path, text)
    assert problems[0].line == line_of(text, "echo from: x")
    assert "spython reads the base image as 'echo  x'" in problems[0].message


def test_a_comment_inside_files_that_spython_takes_for_an_entry_is_named(tmp_path):
    text = real_text().replace("    README.md /opt", "    # note\n    README.md /opt", 1)
    problems = broken(tmp_path, text)
    assert container.Problem(line_of(text, "# note"),
                             "spython reads '# note' as a %files entry") in problems


def test_an_empty_file_lists_every_missing_part():
    problems = container.check_definition_text("")
    assert [p.line for p in problems] == [0, 0, 0, 0, 1]
    assert {p.message.split(":")[0] for p in problems} == {
        "no %files section", "no %post section", "no %runscript section", "no %test section",
        "no 'Bootstrap"}


def test_a_file_that_is_no_definition_is_one_clear_error_not_a_problem_per_line(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text((REPO / "README.md").read_text())
    with pytest.raises(ContainerError, match="is not an Apptainer definition file"):
        check_definition(readme)
    # A definition that lost its Bootstrap header is still checked, problem by problem.
    headless = tmp_path / "headless.def"
    headless.write_text(real_text().replace("Bootstrap: docker\n", ""))
    assert "no 'Bootstrap:' header" in only(check_definition(headless)).message


def test_a_missing_definition_file_is_a_clear_error(tmp_path):
    with pytest.raises(ContainerError, match="does not exist"):
        check_definition(tmp_path / "nope.def")


# --- the CLI -------------------------------------------------------------------------------


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pyrecover", *args], cwd=REPO, text=True,
                          capture_output=True, timeout=60)


def test_image_check_prints_ok_and_exits_0_for_the_real_definition(monkeypatch):
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(app, ["image", "check"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "containers/pyrecover.def: OK"


def test_image_check_prints_def_line_message_and_exits_1_for_a_broken_copy(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    path = tmp_path / "no-test.def"
    path.write_text(without_section(real_text(), "test"))
    result = CliRunner().invoke(app, ["image", "check", str(path)])
    assert result.exit_code == 1
    line = line_of(path.read_text(), "Bootstrap:")
    assert result.output.startswith(f"{path}:{line}: no %test section")


def test_image_check_of_a_missing_file_is_a_usage_error():
    done = run_cli("image", "check", "containers/missing.def")
    assert done.returncode == 2
    assert "does not exist" in done.stderr


def test_image_check_of_a_readme_is_one_error_line():
    done = run_cli("image", "check", "README.md")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "error: 'README.md' is not an Apptainer definition file: it has no 'Bootstrap:' header "
        "and lines of text outside any %section; check a .def file, e.g. "
        "containers/pyrecover.def"]


def test_image_build_without_apptainer_says_how_to_get_it_and_exits_2(tmp_path):
    path_without_apptainer = str(Path(sys.executable).parent)  # the venv's bin, nothing else
    assert container.find_apptainer(path_without_apptainer) is None
    env = {**os.environ, "PATH": path_without_apptainer}
    done = subprocess.run([sys.executable, "-m", "pyrecover", "image", "build",
                           str(DEF), str(tmp_path / "out.sif")], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith("error: apptainer is not installed")
    assert "https://apptainer.org/docs/admin/main/installation.html" in line
    assert not (tmp_path / "out.sif").exists()


def test_image_build_prints_the_exact_command_and_passes_on_its_exit_code(tmp_path):
    # tests/bin/apptainer stands in for apptainer; it supports only `exec`, so it rejects
    # `build` with exit code 255 - which is what this test needs: the command line as run,
    # and apptainer's exit code coming back out of `pyrecover image build`.
    env = {**os.environ, "PATH": f"{STANDIN_DIR}{os.pathsep}{Path(sys.executable).parent}"}
    sif = tmp_path / "out.sif"
    done = subprocess.run([sys.executable, "-m", "pyrecover", "image", "build", str(DEF),
                           str(sif)], cwd=REPO, env=env, text=True, capture_output=True,
                          timeout=60)
    expected = container.build_argv(DEF, sif, fakeroot=os.geteuid() != 0,
                                    apptainer=str(STANDIN_DIR / "apptainer"))
    assert done.stdout.splitlines()[0] == "+ " + shlex.join(expected)
    assert done.returncode == 255
    assert "stand-in supports only `exec`" in done.stderr


def test_image_build_checks_the_definition_before_calling_apptainer(tmp_path):
    path = tmp_path / "no-runscript.def"
    path.write_text(without_section(real_text(), "runscript"))
    env = {**os.environ, "PATH": f"{STANDIN_DIR}{os.pathsep}{Path(sys.executable).parent}"}
    done = subprocess.run([sys.executable, "-m", "pyrecover", "image", "build", str(path),
                           str(tmp_path / "out.sif")], cwd=REPO, env=env, text=True,
                          capture_output=True, timeout=60)
    assert done.returncode == 1
    assert "no %runscript section" in done.stderr
    assert "+ " not in done.stdout
