"""What shortens a trainer's start: the garbage collector off while torch is imported (see
pyrecover/__main__.py), and a bytecode cache where the installed packages have none.

torch._dynamo (which torch's first Optimizer imported, 1.7-4 s here) was once imported in a
background thread to overlap the start-up's waits. Python's per-module import locks made
that unsafe: a main thread importing a module torch._dynamo also imports, while the thread
held torch._dynamo's lock, failed with `_DeadlockError` (seen once in a full test run, in a
compiled run's start). Measured on the 2-core VM it saved next to nothing (the time moved to
the rendezvous), so it is gone.

**The bytecode cache.** Python compiles every module it imports from source unless a `.pyc`
is cached next to it, and it writes one only where it may (`PYTHONDONTWRITEBYTECODE` unset,
the package folder writable). An environment installed without bytecode (`uv` does not
compile by default) that runs with `PYTHONDONTWRITEBYTECODE=1`, or from a read-only image,
compiles torch at every start: on the H200 machine of `make gpu-check` (such a uv
environment) `import torch` and `import torch._dynamo` took 9.4-11.0 s of every start, and
2.6-3.5 s once their bytecode came from a cache. `use_bytecode_cache` (at the CLI's entry
for `train`, before torch is imported; not for `launch`, whose job would inherit it) points
Python at a cache of our own where torch's bytecode is neither installed nor can be written
next to it: `PYRECOVER_PYCACHE` (a folder; `off` to leave Python as it is), by default
`$XDG_CACHE_HOME/pyrecover/pycache` (`~/.cache/...`), used only if no one else may write to
it (Python checks a cached file only against its source's size and time, which anyone can
read). The first start writes it (about 50 MB for torch) and every restart reads it, and an
upgraded package is compiled again. The variables go to the processes it starts (`train
--nproc`'s workers, Inductor's compile workers) through the environment.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

PYCACHE_ENV = "PYRECOVER_PYCACHE"
OFF = frozenset({"0", "off", "no", "false", "none"})
PROBE = "torch"  # the import that costs a start its seconds

# What `use_bytecode_cache` did in this process: the folder, and whether it made it.
BYTECODE_CACHE: Path | None = None
CACHE_CREATED = False


def bytecode_cache_dir(environ: MutableMapping[str, str], source: str | None,
                       dont_write: bool, prefix: str | None) -> Path | None:
    """bytecode_cache_dir is the folder to cache bytecode in, or None where Python finds or
    writes it next to the sources itself: `source` is the probe module's file (torch's
    `__init__.py`), `dont_write` and `prefix` are sys.dont_write_bytecode and
    sys.pycache_prefix. A prefix the user set is theirs; `PYRECOVER_PYCACHE=off` turns it
    off; the default needs an absolute `XDG_CACHE_HOME` or `HOME` (none: no cache)."""
    choice = environ.get(PYCACHE_ENV, "").strip()
    if choice.lower() in OFF or prefix or not source or not source.endswith(".py"):
        return None
    here = Path(source).parent
    installed = Path(importlib.util.cache_from_source(source))  # (prefix is None here)
    if installed.is_file():
        return None
    if not dont_write and os.access(here, os.W_OK):  # Python writes it there on first import
        return None
    if choice:  # made absolute: a relative prefix would follow the working directory
        return Path(os.path.abspath(os.path.expanduser(choice)))
    xdg, home = environ.get("XDG_CACHE_HOME", ""), environ.get("HOME", "")
    if os.path.isabs(xdg):  # (the XDG spec: a relative one is ignored)
        return Path(xdg) / "pyrecover" / "pycache"
    return Path(home) / ".cache" / "pyrecover" / "pycache" if os.path.isabs(home) else None


def use_bytecode_cache(environ: MutableMapping[str, str] = os.environ,
                       probe: str | None = None) -> Path | None:
    """use_bytecode_cache turns the cache on for this process and the ones it starts, where
    `bytecode_cache_dir` says so (module docstring); the folder, or None. Nothing here stops a
    start: a folder that cannot be made or written, or that is not this user's alone (another
    user could put bytecode there that this process would run), leaves Python as it was."""
    global BYTECODE_CACHE, CACHE_CREATED
    try:
        spec = importlib.util.find_spec(probe or PROBE)  # found, not imported
        folder = bytecode_cache_dir(environ, spec.origin if spec else None,
                                    sys.dont_write_bytecode, sys.pycache_prefix)
        if folder is None:
            return None
        created = not folder.is_dir()
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        info = os.stat(folder)
        if info.st_uid != os.getuid() or info.st_mode & 0o022:
            return None
        if not os.access(folder, os.W_OK | os.X_OK):
            return None
    except Exception:  # an odd HOME, a file in the way, no permission: no cache, no failure
        return None
    sys.pycache_prefix = str(folder)
    sys.dont_write_bytecode = False
    environ["PYTHONPYCACHEPREFIX"] = str(folder)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    BYTECODE_CACHE, CACHE_CREATED = folder, created
    return folder


def bytecode_origin(probe: str = PROBE) -> str:
    """bytecode_origin says where this process's torch bytecode comes from, for reports:
    installed with it, written next to it, pyrecover's cache, or compiled at every start."""
    if BYTECODE_CACHE is not None:
        return f"pyrecover's cache {BYTECODE_CACHE}"
    spec = importlib.util.find_spec(probe)
    if spec is None or not spec.origin:
        return "unknown"
    if sys.pycache_prefix:
        return f"the cache {sys.pycache_prefix} (PYTHONPYCACHEPREFIX)"
    if Path(importlib.util.cache_from_source(spec.origin)).is_file():  # (no prefix here)
        return "cached beside the sources"
    if not sys.dont_write_bytecode and os.access(Path(spec.origin).parent, os.W_OK):
        return "written beside the sources at the first start"
    return f"compiled at every start ({PYCACHE_ENV}=off or the cache unusable)"


def bytecode_note() -> dict[str, str]:
    """bytecode_note is what the `imports_done` phase records of a bytecode cache in use: its
    folder (this process's own, or the one `train --nproc`'s launcher passed on)."""
    return {"bytecode_cache": sys.pycache_prefix} if sys.pycache_prefix else {}


def end_startup_imports() -> None:
    """end_startup_imports turns the garbage collector back on where `python -m pyrecover
    train` left it off for the start-up's imports (pyrecover/__main__.py), once the last of
    them (torch._dynamo, where the run needs it: train.py) is done and before anything that
    makes cyclic garbage in bulk (torch.compile at the first step). What the imports allocated
    is frozen out of later collections, which would walk it all again (the exit's gc.collect
    did, for 0.15-0.44 s)."""
    if not gc.isenabled():
        gc.freeze()
        gc.enable()


CPP_LOG_ENV = "TORCH_CPP_LOG_LEVEL"


def quiet_torch_warnings(environ: MutableMapping[str, str] = os.environ) -> None:
    """quiet_torch_warnings keeps torch's C++ warnings (c10's log, read once when torch loads)
    off a trainer's output, for it and the workers it starts, unless the user chose a level.

    A Ctrl-C while a rank waited to connect to the rendezvous store (TCPStore) interrupted the
    client's wait between two tries, which it logged as a warning with ~15 lines of C++ stack
    trace above pyrecover's own line; so did every store connection a peer that ended closed.
    The client retries either way, and a store it cannot reach is still said: an error line of
    torch's (c10's ERROR level is kept), then the failure Python gets."""
    environ.setdefault(CPP_LOG_ENV, "ERROR")
