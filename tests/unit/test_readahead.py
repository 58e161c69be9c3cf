"""The read-ahead `pyrecover train` starts before it imports the trainer (readahead.py): the
newest committed checkpoint comes into the page cache while torch is imported, on the ranks
that read it whole, and nothing else is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from pyrecover import readahead
from pyrecover.bench.state import build_state
from pyrecover.bench.storage import cached_fraction, drop_cache
from pyrecover.checkpoint import CheckpointManager
from pyrecover.rundir import RunDir


def vanilla_run(tmp_path: Path) -> RunDir:
    """A run directory with real vanilla checkpoints of a 4 MB state at steps 2 and 4."""
    src = build_state(1_000_000, seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    saver = CheckpointManager(run, "vanilla", 2, 3, 0, 1, src.parts, torch.device("cpu"), False)
    saver.at_step(2)
    saver.at_step(4)
    saver.finish(4)
    return run


def fake_step(root: Path, step: int, mode: str, files: dict[str, bytes],
              listed: list[str] | None = None) -> Path:
    """A step folder with `files` and a manifest of the shape the store writes, listing
    `listed` (default: the files) with made-up checksums: read-ahead never checks them."""
    folder = root / f"step-{step}"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    names = listed if listed is not None else list(files)
    (folder / "manifest.json").write_text(json.dumps(
        {"mode": mode, "step": step, "world_size": 1, "train_state": {},
         "files": {n: {"size": 1, "sha256": "0" * 64} for n in names}}))
    return folder


def test_a_start_reads_the_newest_checkpoint_into_the_page_cache_and_nothing_older(tmp_path):
    run = vanilla_run(tmp_path)
    newest, older = (run.checkpoints / f"step-{s}" / "state.pt" for s in (4, 2))
    drop_cache([newest, older])
    left = cached_fraction([newest, older])  # None: no mincore here
    if left is None or left >= 0.5:  # tmpfs, ZFS keep the pages (a skip fails under CI)
        pytest.skip("cannot evict a file's pages here: nothing to measure")
    thread = readahead.start(run.checkpoints, rank=0, local_rank=0)
    assert thread is not None
    thread.join()
    assert cached_fraction([newest]) > 0.95
    assert cached_fraction([older]) < 0.5


def test_who_reads_ahead_what(tmp_path):
    root = tmp_path / "checkpoints"
    old = fake_step(root, 2, "vanilla", {"state.pt": b"v" * 100})
    new = fake_step(root, 4, "dcp", {".metadata": b"m", "__0_0.distcp": b"d" * 100,
                                     "extra.json": b"{}"})
    assert readahead.plan(root, 0, 0) == [new / ".metadata", new / "__0_0.distcp",
                                          new / "extra.json"]
    # DCP's parts are each rank's own: another node's first rank leaves them alone; a vanilla
    # file, which every rank reads whole, it reads.
    assert readahead.plan(root, 8, 0) == []
    (new / "manifest.json").write_text("{torn")  # unreadable: the pick falls back past it
    assert readahead.plan(root, 8, 0) == [old / "state.pt"]
    assert readahead.plan(root, 1, 1) == []  # one reader per node
    # Memory mode's parts hold every slice twice over: not read ahead, not even by rank 0;
    # nor anything while a survivors' snapshot waits to be committed (it may be newer).
    fake_step(root, 6, "memory", {"meta-r0.pt": b"m", "part-s0-r0.bin": b"p"})
    assert readahead.plan(root, 0, 0) == []
    (root / ".snap-step-8-r0").mkdir()
    (root / "step-6" / "manifest.json").write_text("{torn")
    assert readahead.plan(root, 8, 0) == []


def test_a_manifest_naming_a_file_outside_its_folder_reads_nothing_of_it(tmp_path):
    root = tmp_path / "checkpoints"
    (tmp_path / "secret").write_bytes(b"s")
    old = fake_step(root, 2, "vanilla", {"state.pt": b"v"})
    fake_step(root, 4, "vanilla", {"state.pt": b"v"}, listed=["../../secret"])
    assert readahead.plan(root, 0, 0) == [old / "state.pt"]
    fake_step(root, 5, "vanilla", {"state.pt": b"v"}, listed=["state\0.pt"])
    assert readahead.plan(root, 0, 0) == [old / "state.pt"]
    (root / "step-7").symlink_to(old, target_is_directory=True)  # verify refuses it too
    assert readahead.plan(root, 0, 0) == [old / "state.pt"]
    link = fake_step(root, 6, "vanilla", {}, listed=["state.pt"])
    (link / "state.pt").symlink_to(tmp_path / "secret")
    assert readahead.plan(root, 0, 0) == [link / "state.pt"]  # listed; the open refuses it
    os.mkfifo(link / "fifo")
    for path in (link / "state.pt", link / "fifo"):  # refused without an error or a wait
        reader = threading.Thread(target=readahead.read_through, args=(path,), daemon=True)
        reader.start()
        reader.join(timeout=60)
        assert not reader.is_alive(), path


def test_nothing_in_a_run_directory_stops_a_start(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    fake_step(root, 2, "vanilla", {"state.pt": b"v"}, listed=["state.pt", "gone.pt"])  # gone
    (root / "step-\u00b2").mkdir()  # a digit int() cannot read: no step folder (store.py)
    with pytest.raises(FileNotFoundError):
        readahead.plan(root, 0, 0)
    escaped = []
    monkeypatch.setattr(threading, "excepthook", escaped.append)
    thread = readahead.start(root, rank=0, local_rank=0)
    assert thread is not None
    thread.join(timeout=60)
    assert not thread.is_alive() and not escaped
    assert readahead.start(root, rank=0, local_rank=1) is None


def test_a_checkpoint_larger_than_a_quarter_of_the_free_memory_is_not_read_ahead(
        tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    fake_step(root, 2, "vanilla", {"state.pt": b"v" * 1000})
    monkeypatch.setattr(readahead, "available_bytes", lambda: 4000)
    assert readahead.plan(root, 0, 0) != []
    monkeypatch.setattr(readahead, "available_bytes", lambda: 3999)
    assert readahead.plan(root, 0, 0) == []
    assert readahead.plan(tmp_path / "none", 0, 0) == []  # no checkpoints yet


def test_the_read_ahead_imports_nothing_that_would_make_it_wait_for_torch():
    out = subprocess.run([sys.executable, "-c", "import pyrecover.readahead, pyrecover.rundir, "
                          "sys; print(*sys.modules)"], capture_output=True, text=True, check=True)
    assert "torch" not in out.stdout.split()
