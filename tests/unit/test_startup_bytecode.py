"""The bytecode cache (startup.py): where the installed packages have no bytecode and Python
may not write it next to them, a start compiles torch from source (9.4-11.0 s of every start
on the H200 machine, 2.6-3.5 s from a cache); pyrecover caches it in a folder of its own."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pyrecover import startup

REPO = Path(__file__).resolve().parents[2]


def package(root: Path, name: str = "probepkg", value: int = 41) -> Path:
    """package writes an importable package with no bytecode; its __init__.py."""
    src = root / name / "__init__.py"
    src.parent.mkdir(parents=True)
    src.write_text(f"VALUE = {value}\n")
    return src


def decide(src: Path, environ: dict[str, str] | None = None, dont_write: bool = True,
           prefix: str | None = None) -> Path | None:
    return startup.bytecode_cache_dir(dict(environ or {}), str(src), dont_write, prefix)


def test_the_cache_is_used_only_where_python_neither_finds_nor_writes_bytecode(tmp_path):
    src = package(tmp_path)
    env = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert decide(src, env) == tmp_path / "xdg" / "pyrecover" / "pycache"
    assert decide(src, env, dont_write=False) is None  # Python writes it next to the source
    installed = Path(importlib.util.cache_from_source(str(src)))
    installed.parent.mkdir()
    installed.write_bytes(b"")  # installed bytecode (pip compiles it): Python reads that
    assert decide(src, env) is None


def test_the_user_chooses_the_folder_turns_it_off_or_has_set_a_prefix_already(tmp_path):
    src = package(tmp_path)
    assert decide(src, {startup.PYCACHE_ENV: str(tmp_path / "mine")}) == tmp_path / "mine"
    for off in ("off", "0", "OFF", "false"):
        assert decide(src, {startup.PYCACHE_ENV: off}) is None
    assert decide(src, {}, prefix=str(tmp_path / "theirs")) is None
    assert startup.bytecode_cache_dir({}, None, True, None) is None  # no torch to probe
    assert decide(src, {"HOME": "/home/u"}) == Path("/home/u/.cache/pyrecover/pycache")
    # Nowhere absolute to put it (a container's arbitrary user, no HOME): no cache.
    assert decide(src, {}) is None
    assert decide(src, {"HOME": "relative"}) is None
    # A relative XDG_CACHE_HOME is ignored (the XDG spec); a relative choice is made absolute,
    # or the cache would follow the working directory of each start.
    assert decide(src, {"XDG_CACHE_HOME": "rel", "HOME": "/h"}) == Path(
        "/h/.cache/pyrecover/pycache")
    assert decide(src, {startup.PYCACHE_ENV: "rel/cache"}) == Path.cwd() / "rel" / "cache"


def run_probe(tmp_path: Path, env: dict[str, str], code: str) -> list[str]:
    script = ("import os, sys\nfrom pyrecover import startup\n"
              "folder = startup.use_bytecode_cache(probe='probepkg')\n" + code)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    return out.stdout.split()


def test_a_start_without_bytecode_writes_it_to_the_cache_and_the_next_start_reads_it(tmp_path):
    src = package(tmp_path / "site")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
           "PYTHONDONTWRITEBYTECODE": "1", startup.PYCACHE_ENV: str(cache)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    first = run_probe(tmp_path, env, (
        "import probepkg\nprint(folder, probepkg.__cached__, probepkg.VALUE,\n"
        "      os.environ.get('PYTHONPYCACHEPREFIX'), os.environ.get('PYTHONDONTWRITEBYTECODE'))"))
    assert first[0] == str(cache)
    cached = Path(first[1])
    assert cached.is_file() and cache in cached.parents, first
    assert first[2] == "41"
    # The processes it starts (train --nproc's workers, Inductor's) write and read it too.
    assert first[3:] == [str(cache), "None"]
    assert not (src.parent / "__pycache__").exists()  # nothing next to the sources
    # The next start reads the cached bytecode instead of compiling: a source of the same
    # size and time that says something else is never looked at.
    stat = src.stat()
    src.write_text("VALUE = 99\n")
    os.utime(src, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    second = run_probe(tmp_path, env, "import probepkg\nprint(probepkg.VALUE)")
    assert second == ["41"]
    said = run_probe(tmp_path, env, "print(startup.bytecode_origin('probepkg') == "
                     f"\"pyrecover's cache {cache}\")")
    assert said == ["True"]  # what gpu-check's report says of it
    # Turned off, the same start compiles the source again, and the report says so.
    off = run_probe(tmp_path, {**env, startup.PYCACHE_ENV: "off"},
                    "import probepkg\nprint(folder, probepkg.VALUE)\n"
                    "print(startup.bytecode_origin('probepkg').startswith('compiled at every'))")
    assert off == ["None", "99", "True"]


def test_a_cache_folder_that_cannot_be_made_leaves_python_as_it_was(tmp_path):
    package(tmp_path / "site")
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be: mkdir fails, as unwritable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
           "PYTHONDONTWRITEBYTECODE": "1", startup.PYCACHE_ENV: str(blocker / "cache")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = run_probe(tmp_path, env, (
        "import probepkg\nprint(folder, sys.pycache_prefix, sys.dont_write_bytecode)"))
    assert out == ["None", "None", "True"]


def test_a_cache_folder_others_may_write_to_is_not_used(tmp_path):
    # Python checks a cached file only against its source's size and time, which anyone can
    # read: bytecode another user put in a folder they can write to would run here.
    package(tmp_path / "site")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
           "PYTHONDONTWRITEBYTECODE": "1", startup.PYCACHE_ENV: str(shared)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    out = run_probe(tmp_path, env, "print(folder, sys.pycache_prefix)")
    assert out == ["None", "None"]
    shared.chmod(0o700)  # this user's alone: used
    assert run_probe(tmp_path, env, "print(folder)") == [str(shared)]


def test_only_train_turns_it_on_so_launch_passes_nothing_to_its_job(tmp_path):
    # `launch` submits with its environment: a prefix from it would follow the job onto
    # nodes and into containers where torch has its bytecode (and Python would ignore it).
    package(tmp_path / "site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), str(REPO)]),
           "PYTHONDONTWRITEBYTECODE": "1", startup.PYCACHE_ENV: str(tmp_path / "cache")}
    env.pop("PYTHONPYCACHEPREFIX", None)
    code = "\n".join([
        "import sys",
        "from pyrecover import startup",
        "startup.PROBE = 'probepkg'  # a package without bytecode stands for torch",
        "sys.argv = ['pyrecover', sys.argv[1], '--help']",
        "from pyrecover.cli import main",
        "try:",
        "    main()",
        "except SystemExit:",
        "    pass",
        "print(sys.pycache_prefix, file=sys.stderr)"])
    said = {cmd: subprocess.run([sys.executable, "-c", code, cmd], env=env, cwd=tmp_path,
                                capture_output=True, text=True, check=True).stderr.split()[-1]
            for cmd in ("train", "launch")}
    assert said == {"train": str(tmp_path / "cache"), "launch": "None"}


@pytest.mark.parametrize("dont_write", ["1", ""])
def test_python_is_left_alone_where_torch_has_its_bytecode(dont_write, tmp_path):
    # This environment's torch was installed by pip, which compiles it: no cache of ours.
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    installed = Path(importlib.util.cache_from_source(spec.origin)).is_file()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": dont_write,
           "XDG_CACHE_HOME": str(tmp_path)}
    env.pop("PYTHONPYCACHEPREFIX", None)
    env.pop(startup.PYCACHE_ENV, None)
    out = subprocess.run([sys.executable, "-c", "from pyrecover import startup\n"
                          "print(startup.use_bytecode_cache())"], env=env,
                         capture_output=True, text=True, check=True)
    writable = not dont_write and os.access(Path(spec.origin).parent, os.W_OK)
    assert (out.stdout.strip() == "None") == (installed or writable)


def test_a_bench_passes_the_users_cache_setting_to_the_trainer_it_times(monkeypatch):
    """`bench restart --local` and `bench memory` time the trainer's start: the user's choice
    of bytecode cache is part of it, while the test hooks and SLURM settings are not."""
    from pyrecover.bench.common import trainer_env

    monkeypatch.setenv(startup.PYCACHE_ENV, "off")
    monkeypatch.setenv("PYRECOVER_KILL_RANK", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    env = trainer_env(("SLURM_", "PYRECOVER_"))
    assert env[startup.PYCACHE_ENV] == "off" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "PYRECOVER_KILL_RANK" not in env and "SLURM_JOB_ID" not in env
    assert "SLURM_JOB_ID" in trainer_env()  # bench memory keeps SLURM's own variables
