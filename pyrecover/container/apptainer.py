"""Apptainer command lines: bind mounts, `apptainer exec` and `apptainer build` argv lists.

Pure: functions build argv lists, nothing runs apptainer (the CLI does, in one place). This
package imports nothing else from pyrecover and never imports torch, so the sbatch renderer
and the CLI can use it at startup.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

INSTALL_DOCS = "https://apptainer.org/docs/admin/main/installation.html"

APPTAINER_MISSING = (
    "apptainer is not installed (neither `apptainer` nor `singularity` is on PATH); install "
    f"your distribution's apptainer package or follow {INSTALL_DOCS}"
)

_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class ContainerError(ValueError):
    """A bad bind, environment variable or definition path: one line naming the bad value."""


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
