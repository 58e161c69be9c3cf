"""Checks of the image's definition file, each problem with its line.

A definition file is checked twice over. spython's `SingularityParser` must read it (other
tools read recipes through it), and what it reads must agree with the file; spython keeps no
line numbers and misreads some lines, so a small scanner (`recipe`) reads the same text line
by line, and the project's rules (a docker base image, the package copied in and installed,
a runscript, a test section) are checked on that scan. spython is imported only inside
`check_definition`.
"""

from __future__ import annotations

import posixpath
import shlex
from pathlib import Path

from pyrecover.container.apptainer import ContainerError
from pyrecover.container.recipe import FileEntry, Problem, Stage, norm_src, scan
from pyrecover.container.shell import post_problems

# What %files must copy, into one folder, for `pip install` of the project to work.
REQUIRED_FILES = {
    "pyproject.toml": "the build file pip installs from",
    "pyrecover": "the package itself",
}


def check_definition(path: str | Path, root: str | Path | None = None) -> list[Problem]:
    """check_definition lists what is wrong with an Apptainer definition file, by line.

    spython must parse the file and agree with it on the base image, the files and the
    runscript and test; and the final stage must: bootstrap from a docker image (Bootstrap +
    From headers), copy pyproject.toml and pyrecover/ into one folder (%files),
    pip-install that folder in %post with --no-deps or a --constraint that pins torch (so
    the base image's CUDA torch stays), and have a %runscript passing "$@" to pyrecover and
    a %test. With `root`, %files sources (relative ones are taken from where apptainer build
    runs) must exist under it. An empty list means the file passed.
    Raises ContainerError if the file cannot be read.
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ContainerError(f"definition file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ContainerError(f"cannot read definition file {str(p)!r}: {exc}") from None
    if not looks_like_definition(text):
        raise ContainerError(
            f"{str(p)!r} is not an Apptainer definition file: it has no 'Bootstrap:' header "
            "and lines of text outside any %section; check a .def file, e.g. "
            "containers/pyrecover.def")
    return check_definition_text(text, root)


# A file with no Bootstrap header and at least this many lines that are neither a header, a
# comment nor in a section is some other text (a README, a script), not a broken definition.
_STRAY_LIMIT = 3


def looks_like_definition(text: str) -> bool:
    """looks_like_definition is False for text that is no definition file at all.

    A definition missing its Bootstrap header is still one (its problems are listed); a
    file with none and lines of prose outside every section is not, and listing a problem
    for each of its lines would bury the one thing to say.
    """
    stages = scan(text.splitlines())
    if any("bootstrap" in stage.headers for stage in stages):
        return True
    return sum(len(stage.stray) for stage in stages) < _STRAY_LIMIT


def check_definition_text(text: str, root: str | Path | None = None) -> list[Problem]:
    """check_definition_text is `check_definition` on the text of a definition file."""
    lines = text.splitlines()
    stages = scan(lines)
    final = stages[-1]
    problems = _header_problems(stages, lines)
    problems += _spython_problems(text, lines, final)
    entries = _file_entries(final)
    project_dir, file_problems = _files_problems(final, entries, root)
    problems += file_problems
    problems += post_problems(final, project_dir)
    problems += _runscript_problems(final)
    problems += _test_problems(final)
    return sorted(set(problems), key=lambda pr: (pr.line, pr.message))


def _header_problems(stages: list[Stage], lines: list[str]) -> list[Problem]:
    problems = []
    for stage in stages:
        problems += [Problem(n, f"{lines[n - 1].strip()!r} is not a 'Keyword: value' header; "
                                "section bodies start after a %section line")
                     for n in stage.stray]
    final = stages[-1]
    if "bootstrap" not in final.headers:
        first = min([n for n, _ in final.headers.values()] + final.stray, default=1)
        problems.append(Problem(first, "no 'Bootstrap:' header: the file must start with "
                                       "'Bootstrap: docker' and a 'From:' image"))
        return problems
    line, agent = final.headers["bootstrap"]
    if final.order and final.order[0] != "bootstrap":
        first_line = final.headers[final.order[0]][0]
        problems.append(Problem(first_line, "'Bootstrap:' must be the first header keyword"))
    if agent.lower() != "docker":
        problems.append(Problem(line, f"'Bootstrap: {agent}': the image must start from a "
                                      "docker image (Bootstrap: docker); spython, which reads "
                                      "the recipe, supports only that"))
    elif not final.headers.get("from", (0, ""))[1]:
        problems.append(Problem(line, "'Bootstrap: docker' needs a 'From:' header naming the "
                                      "base image, e.g. 'From: pytorch/pytorch:2.7.1-cuda12.8-"
                                      "cudnn9-runtime'"))
    return problems


def _spython_parse(text: str):
    """_spython_parse runs spython's SingularityParser on `text`: (recipes, error, culprit).

    The parser is given the lines directly (with a filename it would `sys.exit` on a missing
    file) and its logger is silenced. `culprit` is the line text spython rejected as a
    Bootstrap header, when that is why it failed.
    """
    from spython.logger import bot
    from spython.logger.message import QUIET
    from spython.main.parse.parsers import SingularityParser

    class _Parser(SingularityParser):
        culprit: str | None = None

        def _check_bootstrap(self, line):
            self.culprit = line
            super()._check_bootstrap(line)
            self.culprit = None

    parser = _Parser(filename=None, load=False)
    parser.lines = text.splitlines(keepends=True)
    level, bot.level = bot.level, QUIET
    try:
        return parser.parse(), None, None
    except Exception as exc:  # spython raises what it raises; report it as a problem
        return None, exc, parser.culprit
    finally:
        bot.level = level


def _spython_problems(text: str, lines: list[str], final: Stage) -> list[Problem]:
    recipes, error, culprit = _spython_parse(text)
    if error is not None:
        if culprit is not None:
            number = next((i for i, t in enumerate(lines, 1) if t.strip() == culprit), 0)
            if number and number == final.anchor():
                return []  # the final stage's own non-docker Bootstrap; _header_problems says so
            return [Problem(number, "spython reads this line as a 'Bootstrap:' header (it "
                                    "contains 'bootstrap' outside a section body) and rejects "
                                    f"it: {error}; reword the line")]
        return [Problem(0, f"spython cannot parse this file: {type(error).__name__}: {error}")]
    recipe = list(recipes.values())[-1]
    problems = []
    from_line, from_value = final.headers.get("from", (0, ""))
    if from_value and recipe.fromHeader != from_value.lower():
        culprit_line = _misread_from_line(lines, final, from_line)
        problems.append(Problem(
            culprit_line or from_line,
            f"spython reads the base image as {recipe.fromHeader!r}, not {from_value!r}: it "
            "takes any line containing 'from:' outside a section body (or first in one) as the "
            "From header" + ("; reword this line" if culprit_line else "")))
    for name, lost in (("runscript", recipe.cmd is None), ("test", recipe.test is None)):
        section = final.first(name)
        if lost and section is not None and section.code():
            problems.append(Problem(section.line, f"spython loses this %{name}: its first line "
                                                  "reads as a header to spython (it contains "
                                                  "'from:', 'stage:' or 'bootstrap')"))
    ours = [(n, t.strip()) for s in final.all("files") if not s.args for n, t in s.code()]
    theirs = list(recipe.files)
    for number, entry in ours:
        if entry in theirs:
            theirs.remove(entry)
        else:
            problems.append(Problem(number, "spython loses this %files entry"))
    for entry in theirs:  # e.g. a comment inside %files, which apptainer ignores
        number = next((n for s in final.all("files") for n, t in s.body if t.strip() == entry), 0)
        problems.append(Problem(number, f"spython reads {entry!r} as a %files entry"))
    return problems


def _misread_from_line(lines: list[str], final: Stage, from_line: int) -> int:
    """The last line spython would take as the From header instead of the real one, or 0.

    spython treats as header lines everything outside section bodies and, in each section,
    the leading comment lines and the first line after them (not a leading blank line, which
    makes it read the whole body as the section's).
    """
    in_body = {n for s in final.sections for n, _ in s.body}
    exposed = [n for n in range(1, len(lines) + 1) if n not in in_body and n != from_line]
    for section in final.sections:
        for n, t in section.body:
            if not t.strip():
                break
            exposed.append(n)
            if not t.strip().startswith("#"):
                break
    hits = [n for n in exposed if "from:" in lines[n - 1].lower()]
    return max(hits, default=0)


def _file_entries(stage: Stage) -> list[FileEntry]:
    """_file_entries are the host-to-image copies of %files (not `%files from STAGE`)."""
    entries = []
    for section in stage.all("files"):
        if section.args:
            continue
        for number, raw in section.code():
            try:
                words = shlex.split(raw, comments=True)
            except ValueError:
                words = raw.split("#", 1)[0].split()
            if not words:
                continue
            src = words[0]
            # Taken as the copy's own path unless it ends in '/'. (apptainer's `cp -r` copies
            # into DST instead when DST already exists as a folder; that is not known here.)
            dst = words[1] if len(words) > 1 else src
            if dst.endswith("/"):
                dst = dst + posixpath.basename(src.rstrip("/"))
            entries.append(FileEntry(number, src, posixpath.normpath(posixpath.join("/", dst))))
    return entries


def _files_problems(stage: Stage, entries: list[FileEntry],
                    root: str | Path | None) -> tuple[str | None, list[Problem]]:
    """Checks %files; returns the folder the project lands in (None if unknown) and problems."""
    section = stage.first("files")
    if section is None:
        return None, [Problem(stage.anchor(), "no %files section: copy the project in, e.g. "
                                              "'pyproject.toml /opt/pyrecover/pyproject.toml' "
                                              "and 'pyrecover /opt/pyrecover/pyrecover'")]
    problems = []
    if root is not None:
        for entry in entries:
            if any(c in entry.src for c in "*?[$"):
                continue
            source = Path(root) / entry.src
            if not source.exists():
                problems.append(Problem(entry.line, f"%files source {entry.src!r} does not exist "
                                                    f"under {root} (apptainer build reads "
                                                    "relative sources from where it runs: the "
                                                    "project root)"))
    whole = [e for e in entries if norm_src(e.src) == "."]
    if whole:  # `. /opt/pyrecover` copies everything at once
        return whole[0].dst, problems
    landed: dict[str, FileEntry] = {}
    for entry in entries:
        name = posixpath.basename(norm_src(entry.src))
        if name in REQUIRED_FILES and name not in landed:
            landed[name] = entry
    missing = [name for name in REQUIRED_FILES if name not in landed]
    for name in missing:
        problems.append(Problem(section.line, f"%files does not copy {name} into the image "
                                              f"({REQUIRED_FILES[name]})"))
    folders = {name: posixpath.dirname(e.dst) for name, e in landed.items()}
    project = folders.get("pyproject.toml")
    for name, entry in landed.items():
        if project is not None and folders[name] != project:
            problems.append(Problem(entry.line, f"{name} lands in {folders[name]}, pyproject.toml "
                                                f"in {project}; pip install needs them in one "
                                                "folder"))
    return project, problems


def _runscript_problems(stage: Stage) -> list[Problem]:
    sections = stage.all("runscript")
    if not sections:
        return [Problem(stage.anchor(), "no %runscript section: `apptainer run IMAGE ...` would "
                                        "do nothing; add one with 'exec pyrecover \"$@\"'")]
    code = [t for s in sections for _, t in s.code()]
    if not code:
        return [Problem(sections[0].line, "the %runscript section is empty; it should run "
                                          "'exec pyrecover \"$@\"'")]
    joined = "\n".join(code)
    if "pyrecover" not in joined or '"$@"' not in joined:
        return [Problem(sections[0].line, "the %runscript should pass its arguments to the CLI: "
                                          "'exec pyrecover \"$@\"'")]
    return []


def _test_problems(stage: Stage) -> list[Problem]:
    sections = stage.all("test")
    if not sections:
        return [Problem(stage.anchor(), "no %test section: add one that imports torch, reports "
                                        "CUDA and NCCL and runs `pyrecover --help`, so a broken "
                                        "image fails when it is built")]
    if not any(s.code() for s in sections):
        return [Problem(sections[0].line, "the %test section is empty")]
    return []
