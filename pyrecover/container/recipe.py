"""A definition file read line by line: stages of headers and sections, each with its line.

spython keeps no line numbers and misreads some lines, so this scanner reads the same text
itself; the checks in `definition` and `shell` report problems at these lines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Section names apptainer knows; a line `%name ...` with one of these starts a section.
SECTIONS = frozenset({
    "setup", "files", "labels", "environment", "post", "runscript", "startscript", "test",
    "help", "arguments", "appinstall", "appfiles", "appenv", "apphelp", "applabels", "apprun",
    "apptest", "appstart",
})

_HEADER = re.compile(r"^\s*([A-Za-z][A-Za-z0-9_-]*)\s*:\s*(.*?)\s*$")

_SECTION = re.compile(r"^\s*%([A-Za-z]+)\b\s*(.*?)\s*$")


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a definition file, at a 1-based line (0: the file as a whole)."""

    line: int
    message: str

    def format(self, path: str | Path) -> str:
        """format is `PATH:LINE: message`, the way compilers report, for editors to jump to."""
        return f"{path}:{self.line}: {self.message}"


@dataclass
class Section:
    name: str
    line: int
    args: str
    body: list[tuple[int, str]] = field(default_factory=list)

    def code(self) -> list[tuple[int, str]]:
        """The body without blank and comment lines."""
        return [(n, t) for n, t in self.body if t.strip() and not t.strip().startswith("#")]


@dataclass
class Stage:
    headers: dict[str, tuple[int, str]] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)
    stray: list[int] = field(default_factory=list)

    def first(self, name: str) -> Section | None:
        return next((s for s in self.sections if s.name == name), None)

    def all(self, name: str) -> list[Section]:
        return [s for s in self.sections if s.name == name]

    def anchor(self) -> int:
        """The line a missing section is reported at: Bootstrap's, else 0 (the whole file)."""
        return self.headers.get("bootstrap", (0, ""))[0]


@dataclass(frozen=True)
class FileEntry:
    line: int
    src: str
    dst: str  # where it lands inside the image (absolute)


def scan(lines: list[str]) -> list[Stage]:
    """scan splits the file into stages (each from a Bootstrap header) of headers + sections."""
    stages = [Stage()]
    section: Section | None = None
    for number, raw in enumerate(lines, start=1):
        stripped = raw.strip()
        header = _HEADER.match(raw)
        if header and header.group(1).lower() == "bootstrap" and (
                section is not None or "bootstrap" in stages[-1].headers):
            stages.append(Stage())  # a new stage of a multi-stage build
            section = None
        heading = _SECTION.match(raw)
        if heading and heading.group(1).lower() in SECTIONS:
            section = Section(heading.group(1).lower(), number, heading.group(2))
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


def norm_src(src: str) -> str:
    src = src.rstrip("/") or "/"
    while src.startswith("./"):
        src = src[2:]
    return src or "."
