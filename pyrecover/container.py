"""Apptainer command lines and checks of the image's definition file.

Everything here is pure: functions build argv lists and read files, nothing runs apptainer
(the CLI does, in one place). This module imports nothing else from pyrecover and never
imports torch, so the sbatch renderer and the CLI can use it at startup; spython is
imported only inside `check_definition`.

A definition file is checked twice over. spython's `SingularityParser` must read it (other
tools read recipes through it), and what it reads must agree with the file; spython keeps no
line numbers and misreads some lines, so a small scanner here reads the same text line by
line, and the project's rules (a docker base image, the package copied in and installed,
a runscript, a test section) are checked on that scan, each problem with its line.
"""

from __future__ import annotations

import posixpath
import re
import shlex
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

INSTALL_DOCS = "https://apptainer.org/docs/admin/main/installation.html"
APPTAINER_MISSING = (
    "apptainer is not installed (neither `apptainer` nor `singularity` is on PATH); install "
    f"your distribution's apptainer package or follow {INSTALL_DOCS}"
)

# Section names apptainer knows; a line `%name ...` with one of these starts a section.
SECTIONS = frozenset({
    "setup", "files", "labels", "environment", "post", "runscript", "startscript", "test",
    "help", "arguments", "appinstall", "appfiles", "appenv", "apphelp", "applabels", "apprun",
    "apptest", "appstart",
})
# What %files must copy, into one folder, for `pip install` of the project to work.
REQUIRED_FILES = {
    "pyproject.toml": "the build file pip installs from",
    "pyrecover": "the package itself",
}
# pip install options that take a value (so the value is not a requirement).
_PIP_VALUE_OPTIONS = frozenset({
    "-c", "--constraint", "-r", "--requirement", "-t", "--target", "--prefix", "--root",
    "-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--upgrade-strategy",
    "--root-user-action", "-C", "--config-settings", "--global-option", "--python",
    "--platform", "--python-version", "--implementation", "--abi", "--src", "--report",
    "--log", "--cache-dir", "--proxy", "--retries", "--timeout", "--exists-action",
    "--trusted-host", "--cert", "--client-cert", "--only-binary", "--no-binary",
    "--progress-bar",
})
_COMMAND_SEPARATORS = frozenset({";", "&&", "||", "|", "&", "(", ")", ";;", "\n"})
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_HEADER = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_-]*)\s*:\s*(.*?)\s*$")
_SECTION = re.compile(r"^\s*%([A-Za-z]+)\b\s*(.*?)\s*$")
_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


class ContainerError(ValueError):
    """A bad bind, environment variable or definition path: one line naming the bad value."""


# --- command lines ------------------------------------------------------------------------


@dataclass(frozen=True)
class Bind:
    """One `--bind`: host path `src` at `dst` inside the container (same path if None)."""

    src: str
    dst: str | None = None
    read_only: bool = False

    def spec(self) -> str:
        """spec is the value apptainer's --bind takes: SRC, SRC:DST or SRC:DST:ro."""
        if self.read_only:
            return f"{self.src}:{self.dst or self.src}:ro"
        return self.src if self.dst is None else f"{self.src}:{self.dst}"


def parse_bind(text: str) -> Bind:
    """parse_bind reads `SRC[:DST[:ro|rw]]` as apptainer's --bind does; raises ContainerError.

    DST must be absolute (it is a path inside the container); SRC may be relative (apptainer
    resolves it from the directory it runs in). A `,` is refused: apptainer would split the
    value into two binds there.
    """
    if not text or not text.strip():
        raise ContainerError("empty bind: expected SRC[:DST[:ro|rw]], e.g. /scratch/runs:/runs")
    if "," in text:
        raise ContainerError(f"bind {text!r}: ',' separates binds for apptainer; pass each "
                             "bind on its own")
    parts = text.split(":")
    if len(parts) > 3:
        raise ContainerError(f"bind {text!r}: expected SRC[:DST[:ro|rw]], got {len(parts)} "
                             "':'-separated fields (a path cannot contain ':')")
    src = parts[0]
    if not src:
        raise ContainerError(f"bind {text!r}: the source (host) path is empty")
    dst = parts[1] if len(parts) > 1 else None
    if dst is not None and not dst:
        raise ContainerError(f"bind {text!r}: the destination is empty; write SRC or SRC:DST")
    if dst is not None and not dst.startswith("/"):
        hint = f"; for a read-only bind write {src}:{src}:{dst}" if dst in ("ro", "rw") else ""
        raise ContainerError(f"bind {text!r}: the destination {dst!r} must be an absolute path "
                             f"inside the container{hint}")
    read_only = False
    if len(parts) == 3:
        if parts[2] not in ("ro", "rw"):
            raise ContainerError(f"bind {text!r}: the option must be 'ro' or 'rw', "
                                 f"got {parts[2]!r}")
        read_only = parts[2] == "ro"
    return Bind(src, dst, read_only)


def exec_argv(
    image: str | Path,
    command: Sequence[str],
    binds: Sequence[Bind | str] = (),
    nv: bool = True,
    env: Mapping[str, str] | None = None,
    *,
    pwd: str | None = None,
    cleanenv: bool = False,
    apptainer: str = "apptainer",
) -> list[str]:
    """exec_argv is the argv of `apptainer exec` running `command` in `image`.

    Order: apptainer exec [--nv] [--cleanenv] [--pwd DIR] (--bind SPEC)... (--env K=V)...
    IMAGE COMMAND... Binds keep the caller's order (a later bind may mount inside an earlier
    one); variables are sorted by name, so the same inputs give the same line. Each element
    is one unquoted argument: join with `shlex.join` for a shell script, never with spaces.
    Binds given as strings go through `parse_bind`. Raises ContainerError for a bad bind or
    variable. SLURM's variables reach the container unless `cleanenv` (the trainer reads
    them inside), so leave it off for training tasks.
    """
    if not command:
        raise ContainerError("apptainer exec needs a command to run in the container")
    argv = [apptainer, "exec"]
    if nv:
        argv.append("--nv")
    if cleanenv:
        argv.append("--cleanenv")
    if pwd is not None:
        argv += ["--pwd", pwd]
    for bind in binds:
        argv += ["--bind", (parse_bind(bind) if isinstance(bind, str) else bind).spec()]
    for key in sorted(env or {}):
        argv += ["--env", env_arg(key, (env or {})[key])]
    return [*argv, str(image), *command]


def env_arg(key: str, value: str) -> str:
    """env_arg is one `--env` value, `KEY=VALUE`, refused where apptainer would misread it.

    apptainer parses --env like pflag's string-to-string flag: with exactly one `=` the whole
    text is one pair (commas allowed, surrounding `"` stripped); with more, it is read as CSV,
    so a value holding both `=` and `,` would be split into several pairs.
    """
    if not _ENV_KEY.fullmatch(key):
        raise ContainerError(f"environment variable name {key!r}: use letters, digits and '_', "
                             "not starting with a digit")
    value = str(value)
    if "\n" in value or "\0" in value or '"' in value:
        raise ContainerError(f"--env {key}: the value {value!r} contains a newline, NUL or '\"', "
                             "which apptainer's --env cannot carry; pass it through a file")
    if "=" in value and "," in value:
        raise ContainerError(f"--env {key}: the value {value!r} has both '=' and ','; apptainer "
                             "would split it into several variables")
    return f"{key}={value}"


def build_argv(def_path: str | Path, sif_path: str | Path, fakeroot: bool, *,
               force: bool = False, apptainer: str = "apptainer") -> list[str]:
    """build_argv is `apptainer build [--fakeroot] [--force] SIF DEF`.

    Use fakeroot when not root: it builds as an unprivileged user where the host allows it
    (subuid/subgid ranges or apptainer's own fakeroot). Without `force` apptainer asks before
    it overwrites an existing SIF.
    """
    argv = [apptainer, "build"]
    if fakeroot:
        argv.append("--fakeroot")
    if force:
        argv.append("--force")
    return [*argv, str(sif_path), str(def_path)]


def find_apptainer(path: str | None = None) -> str | None:
    """find_apptainer is the path of `apptainer`, else of `singularity`, on PATH (or `path`)."""
    return shutil.which("apptainer", path=path) or shutil.which("singularity", path=path)


# --- definition files ---------------------------------------------------------------------


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a definition file, at a 1-based line (0: the file as a whole)."""

    line: int
    message: str

    def format(self, path: str | Path) -> str:
        """format is `PATH:LINE: message`, the way compilers report, for editors to jump to."""
        return f"{path}:{self.line}: {self.message}"


@dataclass
class _Section:
    name: str
    line: int
    args: str
    body: list[tuple[int, str]] = field(default_factory=list)

    def code(self) -> list[tuple[int, str]]:
        """The body without blank and comment lines."""
        return [(n, t) for n, t in self.body if t.strip() and not t.strip().startswith("#")]


@dataclass
class _Stage:
    headers: dict[str, tuple[int, str]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    sections: list[_Section] = field(default_factory=list)
    stray: list[int] = field(default_factory=list)

    def first(self, name: str) -> _Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def all(self, name: str) -> list[_Section]:
        return [s for s in self.sections if s.name == name]

    def anchor(self) -> int:
        """The line a missing section is reported at: Bootstrap's, else 0 (the whole file)."""
        return self.headers.get("bootstrap", (0, ""))[0]


@dataclass(frozen=True)
class _FileEntry:
    line: int
    src: str
    dst: str  # where it lands inside the image (absolute)


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
    return check_definition_text(text, root)


def check_definition_text(text: str, root: str | Path | None = None) -> list[Problem]:
    """check_definition_text is `check_definition` on the text of a definition file."""
    lines = text.splitlines()
    stages = _scan(lines)
    final = stages[-1]
    problems = _header_problems(stages, lines)
    problems += _spython_problems(text, lines, final)
    entries = _file_entries(final)
    project_dir, file_problems = _files_problems(final, entries, root)
    problems += file_problems
    problems += _post_problems(final, project_dir)
    problems += _runscript_problems(final)
    problems += _test_problems(final)
    return sorted(set(problems), key=lambda pr: (pr.line, pr.message))


# --- the scanner ----------------------------------------------------------------------------


def _scan(lines: list[str]) -> list[_Stage]:
    """_scan splits the file into stages (each from a Bootstrap header) of headers + sections."""
    stages = [_Stage()]
    section: _Section | None = None
    for number, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        header = _HEADER.match(raw)
        if header and header.group(1).lower() == "bootstrap" and (
                section is not None or "bootstrap" in stages[-1].headers):
            stages.append(_Stage())  # a new stage of a multi-stage build
            section = None
        heading = _SECTION.match(raw)
        if heading and heading.group(1).lower() in SECTIONS:
            section = _Section(heading.group(1).lower(), number, heading.group(2))
            stages[-1].sections.append(section)
        elif section is not None:
            section.body.append((number, raw))
        elif not stripped or stripped.startswith("#"):
            continue
        elif header:
            key = header.group(1).lower()
            value = header.group(2).split("#", 1)[0].strip()
            stages[-1].headers.setdefault(key, (number, value))
            stages[-1].order.append(key)
        else:
            stages[-1].stray.append(number)
    return stages


def _header_problems(stages: list[_Stage], lines: list[str]) -> list[Problem]:
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


# --- spython --------------------------------------------------------------------------------


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


def _spython_problems(text: str, lines: list[str], final: _Stage) -> list[Problem]:
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


def _misread_from_line(lines: list[str], final: _Stage, from_line: int) -> int:
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


# --- the project's rules ----------------------------------------------------------------------


def _file_entries(stage: _Stage) -> list[_FileEntry]:
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
            entries.append(_FileEntry(number, src, posixpath.normpath(posixpath.join("/", dst))))
    return entries


def _files_problems(stage: _Stage, entries: list[_FileEntry],
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
    whole = [e for e in entries if _norm_src(e.src) == "."]
    if whole:  # `. /opt/pyrecover` copies everything at once
        return whole[0].dst, problems
    landed: dict[str, _FileEntry] = {}
    for entry in entries:
        name = posixpath.basename(_norm_src(entry.src))
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


def _norm_src(src: str) -> str:
    src = src.rstrip("/") or "/"
    while src.startswith("./"):
        src = src[2:]
    return src or "."


@dataclass(frozen=True)
class _Command:
    line: int
    words: list[str]


def _commands(body: list[tuple[int, str]]) -> list[_Command]:
    """_commands splits a shell section into simple commands, skipping here-document bodies."""
    commands: list[_Command] = []
    pending, start, heredoc = "", 0, None
    for number, raw in body:
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        if not pending:
            start = number
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        words = _split_shell(pending + raw)
        pending = ""
        current: list[str] = []
        for i, word in enumerate(words):
            if word == "<<" and i + 1 < len(words):  # `<<-EOF` splits into `<<`, `-EOF`
                heredoc = words[i + 1].removeprefix("-")
            if word in _COMMAND_SEPARATORS:
                if current:
                    commands.append(_Command(start, current))
                current = []
            else:
                current.append(word)
        if current:
            commands.append(_Command(start, current))
    return commands


def _split_shell(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: good enough to look for words
        return text.split("#", 1)[0].split()


def _pip_install_args(words: list[str]) -> list[str] | None:
    """The arguments after `install` if `words` is a pip install command, else None."""
    for i, word in enumerate(words):
        name = posixpath.basename(word)
        # `pip ...`, `/opt/conda/bin/pip3 ...`, `python -m pip ...` or `uv pip ...`
        is_pip = (i == 0 and re.fullmatch(r"pip[0-9.]*", name) is not None) or (
            name == "pip" and i > 0 and words[i - 1] in ("-m", "uv"))
        if is_pip:
            rest = [w for w in words[i + 1:] if not w.startswith("-")]
            if rest[:1] == ["install"]:
                return words[words.index("install", i + 1) + 1:]
            return None
    return None


def _install_targets(args: list[str], cwd: str) -> tuple[list[str], bool]:
    """Requirement arguments of pip install, as paths where they look like paths; and pinned."""
    targets, pinned, skip = [], False, False
    for arg in args:
        if skip:
            skip = False
            continue
        option = arg.split("=", 1)[0]
        if option in ("--no-deps", "-c", "--constraint"):
            pinned = True
        if arg.startswith("-"):
            skip = option in _PIP_VALUE_OPTIONS and "=" not in arg
            continue
        target = re.sub(r"\[.*\]$", "", arg.split(" @ ")[-1])
        target = target.removeprefix("file://")
        if target.startswith((".", "/")):
            target = posixpath.normpath(posixpath.join(cwd, target))
        targets.append(target)
    return targets, pinned


def _post_problems(stage: _Stage, project_dir: str | None) -> list[Problem]:
    posts = stage.all("post")
    if not posts:
        return [Problem(stage.anchor(), "no %post section: install the project there, e.g. "
                                        "'python -m pip install --constraint <torch pin> "
                                        "/opt/pyrecover'")]
    variables: dict[str, str] = {}
    cwd = "/"  # apptainer runs %post in /
    installs: list[tuple[_Command, bool]] = []
    for section in posts:
        for command in _commands(section.body):
            words = [_expand(w, variables) for w in command.words]
            assignments = [w for w in words if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]
            if words[0] in ("export", "declare", "readonly") or len(assignments) == len(words):
                for w in assignments:
                    key, _, value = w.partition("=")
                    variables[key] = value
                continue
            if words[0] == "cd" and len(words) > 1:
                cwd = posixpath.normpath(posixpath.join(cwd, words[1]))
                continue
            args = _pip_install_args(words)
            if args is None or project_dir is None:
                continue
            targets, pinned = _install_targets(args, cwd)
            if project_dir in targets:
                pinned = pinned or "PIP_CONSTRAINT" in variables or "PIP_NO_DEPS" in variables
                installs.append((command, pinned))
    if project_dir is None:
        return []  # %files already has a problem; nothing to compare the install with
    if not installs:
        return [Problem(posts[0].line, f"%post does not pip-install the project copied to "
                                       f"{project_dir}; add e.g. 'python -m pip install "
                                       f"--constraint <torch pin> {project_dir}'")]
    return [Problem(command.line, "pip installs the project without --no-deps or a --constraint "
                                  "pinning torch, so it may replace the base image's CUDA torch")
            for command, pinned in installs if not pinned]


def _expand(word: str, variables: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), word)


def _runscript_problems(stage: _Stage) -> list[Problem]:
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


def _test_problems(stage: _Stage) -> list[Problem]:
    sections = stage.all("test")
    if not sections:
        return [Problem(stage.anchor(), "no %test section: add one that imports torch, reports "
                                        "CUDA and NCCL and runs `pyrecover --help`, so a broken "
                                        "image fails when it is built")]
    if not any(s.code() for s in sections):
        return [Problem(sections[0].line, "the %test section is empty")]
    return []
