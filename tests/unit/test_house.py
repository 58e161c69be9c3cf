"""The package's layout: no import circle, typer only in the CLI, matplotlib only in the plot,
and no module much longer than a person reads in one go.

Imports are read from the source (ast), including those inside functions, which hide ties
that a look at the top of a file misses.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "pyrecover"
MAX_LINES = 400


def modules(root: Path) -> dict[str, Path]:
    """modules maps each dotted module name under `root` (a package folder) to its file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports(name: str, path: Path, known: set[str]) -> dict[str, set[str]]:
    """imports maps each module `name` imports (of `known`, or a third-party top-level name)
    to the lines it does so on; an import of a package's name counts for the package only."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, set[str]] = {}

    def add(target: str, line: int) -> None:
        while target not in known and "." in target:
            target = target.rpartition(".")[0]
        found.setdefault(target, set()).add(f"{path.name}:{line}")

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in known else base, node.lineno)
    found.pop(name, None)
    return found


def graph(root: Path) -> tuple[dict[str, dict[str, set[str]]], set[str]]:
    found = modules(root)
    known = set(found)
    return {name: imports(name, path, known) for name, path in found.items()}, known


def circles(edges: dict[str, dict[str, set[str]]], known: set[str]) -> list[list[str]]:
    """circles lists one import circle per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, {}):
            if w not in known:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def importers(edges: dict[str, dict[str, set[str]]], top: str) -> dict[str, set[str]]:
    return {name: where for name, deps in edges.items()
            for dep, where in deps.items() if dep == top or dep.startswith(top + ".")}


def test_the_package_has_no_import_circle():
    edges, known = graph(PACKAGE)
    found = circles(edges, known)
    detail = [" <-> ".join(group) + ": " + "; ".join(
        f"{a} imports {b} ({', '.join(sorted(edges[a][b]))})"
        for a in group for b in group if b in edges[a]) for group in found]
    assert not found, "import circles:\n" + "\n".join(detail)


def test_only_the_cli_imports_typer():
    edges, _ = graph(PACKAGE)
    outside = {name: where for name, where in importers(edges, "typer").items()
               if name != "pyrecover.cli" and not name.startswith("pyrecover.cli.")}
    assert not outside, f"typer imported outside pyrecover/cli/: {outside}"


def test_only_the_plot_imports_matplotlib():
    edges, _ = graph(PACKAGE)
    assert set(importers(edges, "matplotlib")) <= {"pyrecover.plot"}


def test_checkpoint_builds_no_model_and_no_optimizer():
    """The checkpoint package reads and writes state into live objects its callers build
    (pyrecover/offline.py for `pyrecover ckpt`, train.py for a run)."""
    edges, _ = graph(PACKAGE)
    builders = {"pyrecover.model", "pyrecover.optim", "pyrecover.offline"}
    reached = {name: sorted(set(deps) & builders) for name, deps in edges.items()
               if name.startswith("pyrecover.checkpoint") and set(deps) & builders}
    assert not reached, f"checkpoint/ imports what builds the model: {reached}"


def test_every_mode_reads_its_own_checkpoints_and_every_convert_format_has_its_writer():
    """Adding a mode means its module implements mode.Offline; the ckpt tools dispatch on
    the table, never on a mode's name."""
    from pyrecover.checkpoint import listing, modes
    from pyrecover.checkpoint.mode import Offline, Writer

    assert set(modes.OFFLINE) == set(modes.MODES)
    for name in modes.MODES:
        assert isinstance(modes.offline(name), Offline), name
    assert set(modes.CONVERT_TO) == set(listing.CONVERT_TO)
    for to in listing.CONVERT_TO:
        assert isinstance(modes.writer(to), Writer), to
    tools = (PACKAGE / "checkpoint" / "tools.py").read_text()
    assert ".NAME" not in tools and "ckpt.mode ==" not in tools


@pytest.mark.parametrize("name", sorted(modules(PACKAGE)))
def test_no_module_is_over_400_lines(name):
    lines = len(modules(PACKAGE)[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it where its concerns part"


def test_the_walk_finds_a_circle_hidden_in_a_function_and_a_relative_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text("def f():\n    from pkg import a\n")
    (pkg / "d.py").write_text("import pkg.a\nimport typer\n")
    edges, known = graph(pkg)
    assert circles(edges, known) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]
    assert set(importers(edges, "typer")) == {"pkg.d"}
