"""The shell of %post read closely enough to find the project's `pip install` and check it."""

from __future__ import annotations

import posixpath
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from pyrecover.container.recipe import Problem, Stage

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

_VAR = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))")


@dataclass(frozen=True)
class Command:
    line: int
    words: list[str]


def commands(body: list[tuple[int, str]]) -> list[Command]:
    """commands splits a shell section into simple commands, skipping here-document bodies."""
    commands: list[Command] = []
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
        words = split_shell(pending + raw)
        pending = ""
        current: list[str] = []
        for i, word in enumerate(words):
            if word == "<<" and i + 1 < len(words):  # `<<-EOF` splits into `<<`, `-EOF`
                heredoc = words[i + 1].removeprefix("-")
            if word in _COMMAND_SEPARATORS:
                if current:
                    commands.append(Command(start, current))
                current = []
            else:
                current.append(word)
        if current:
            commands.append(Command(start, current))
    return commands


def split_shell(text: str) -> list[str]:
    lexer = shlex.shlex(text, posix=True, punctuation_chars=";&|()<>")
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # unbalanced quotes: good enough to look for words
        return text.split("#", 1)[0].split()


def pip_install_args(words: list[str]) -> list[str] | None:
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


def install_targets(args: list[str], cwd: str) -> tuple[list[str], bool]:
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


def post_problems(stage: Stage, project_dir: str | None) -> list[Problem]:
    posts = stage.all("post")
    if not posts:
        return [Problem(stage.anchor(), "no %post section: install the project there, e.g. "
                                        "'python -m pip install --constraint <torch pin> "
                                        "/opt/pyrecover'")]
    variables: dict[str, str] = {}
    cwd = "/"  # apptainer runs %post in /
    installs: list[tuple[Command, bool]] = []
    for section in posts:
        for command in commands(section.body):
            words = [expand(w, variables) for w in command.words]
            assignments = [w for w in words if re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", w)]
            if words[0] in ("export", "declare", "readonly") or len(assignments) == len(words):
                for w in assignments:
                    key, _, value = w.partition("=")
                    variables[key] = value
                continue
            if words[0] == "cd" and len(words) > 1:
                cwd = posixpath.normpath(posixpath.join(cwd, words[1]))
                continue
            args = pip_install_args(words)
            if args is None or project_dir is None:
                continue
            targets, pinned = install_targets(args, cwd)
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


def expand(word: str, variables: Mapping[str, str]) -> str:
    return _VAR.sub(lambda m: variables.get(m.group(1) or m.group(2), m.group(0)), word)
