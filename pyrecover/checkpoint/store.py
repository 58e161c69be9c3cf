"""The commit protocol every checkpoint mode shares, and reading committed checkpoints back.

A checkpoint is committed by: write every file into `checkpoints/.tmp-step-<N>-<id>/`, fsync
each file and the folder, write `manifest.json` last (mode, step, world size, train state,
each file's size and checksum), rename the folder to `step-<N>/` and fsync `checkpoints/`.
A folder without a manifest whose files all verify does not exist for the loader.

A file's checksum is either `sha256` (of the whole file, as `sha256sum` prints it) or
`sha256_tree`: the sha256 of the concatenated sha256 digests of each `TREE_BLOCK` bytes of the
file. The tree form lets several cores hash one large file at once, while writing it and
again when verifying it; on one core sha256 runs at about the speed of a local NVMe disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

MANIFEST = "manifest.json"
FORMAT = 1
_CHUNK = 8 << 20
TREE_BLOCK = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder and the file."""


class HashingWriter:
    """A write-only file object that hashes and counts what passes through it."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self.sha = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None  # torch.save reports a failed write as RuntimeError

    def write(self, data: bytes | memoryview) -> int:
        self.sha.update(data)
        self.size += len(data)
        try:
            return self._f.write(data)
        except OSError as exc:
            self.error = exc
            raise

    def flush(self) -> None:
        self._f.flush()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def block_digest(block: bytes | memoryview) -> bytes:
    """block_digest is one TREE_BLOCK's sha256 (hashlib releases the GIL while hashing)."""
    return hashlib.sha256(block).digest()


def tree_digest(block_digests: list[bytes]) -> str:
    """tree_digest combines the per-block digests of a file, in order, into its checksum."""
    return hashlib.sha256(b"".join(block_digests)).hexdigest()


def sha256_tree_file(path: Path, threads: int = 0) -> str:
    """sha256_tree_file is the `sha256_tree` checksum of a file, hashed by `threads` cores."""
    threads = threads or max(1, min(4, os.cpu_count() or 1))
    digests: list[bytes] = []
    waiting: deque[Future] = deque()
    with path.open("rb", buffering=0) as f, ThreadPoolExecutor(threads) as pool:
        while block := f.read(TREE_BLOCK):
            waiting.append(pool.submit(block_digest, block))
            if len(waiting) > 2 * threads:  # bounded read-ahead: a few blocks in memory
                digests.append(waiting.popleft().result())
        digests += [w.result() for w in waiting]
    return tree_digest(digests)


def checksum_ok(path: Path, meta: dict[str, Any]) -> bool:
    """checksum_ok compares a file with its manifest entry, whichever checksum it has."""
    if "sha256_tree" in meta:
        return sha256_tree_file(path) == meta["sha256_tree"]
    return sha256_file(path) == meta["sha256"]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass
class Pending:
    """A checkpoint being written: files go into `tmp`; `commit` makes it exist."""

    root: Path  # the run's checkpoints/ folder
    step: int
    tmp: Path
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def open(self, name: str):
        """open returns a context manager writing `name` with hashing and fsync on close."""
        return _FileSink(self, name)

    def add_existing(self, name: str) -> None:
        """add_existing records a file some other writer put into `tmp` (hashes it, fsyncs it)."""
        path = self.tmp / name
        with path.open("rb") as f:
            os.fsync(f.fileno())
        self.files[name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}

    def commit(self, mode: str, world_size: int, train_state: dict[str, Any],
               extra: dict[str, Any] | None = None) -> Path:
        """commit writes the manifest last, renames into `step-<N>/` and returns that folder."""
        manifest = {
            "format": FORMAT, "mode": mode, "step": self.step, "world_size": world_size,
            "time": time.time(), "train_state": train_state, "files": self.files,
            **(extra or {}),
        }
        mpath = self.tmp / MANIFEST
        with mpath.open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        final = self.root / f"step-{self.step}"
        if final.exists():
            # Only an older run of the same step can be here (a resume that redid this step):
            # the new one replaces it. Rename it aside first so one of the two is always whole.
            aside = self.root / f".old-step-{self.step}-{uuid.uuid4().hex[:8]}"
            os.rename(final, aside)
            os.rename(self.tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.rename(self.tmp, final)
        fsync_dir(self.root)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


class _FileSink:
    def __init__(self, pending: Pending, name: str) -> None:
        self.pending, self.name = pending, name

    def __enter__(self) -> HashingWriter:
        self._f = (self.pending.tmp / self.name).open("wb")
        self._w = HashingWriter(self._f)
        return self._w

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self._f.flush()
                os.fsync(self._f.fileno())
                self.pending.files[self.name] = {"size": self._w.size,
                                                 "sha256": self._w.sha.hexdigest()}
        finally:
            try:
                self._f.close()
            except OSError:
                if exc_type is None:
                    raise
        if exc is not None and not isinstance(exc, OSError) and self._w.error is not None:
            # A full disk, say, under torch.save: raise the OSError, not torch's wrapper.
            raise self._w.error from exc


def begin(root: Path, step: int) -> Pending:
    """begin creates the temporary folder of a new checkpoint for `step`."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return Pending(root=root, step=step, tmp=tmp)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    manifest: dict[str, Any]

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def mode(self) -> str:
        return str(self.manifest["mode"])

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.manifest["files"].values())


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """committed_steps lists `step-<N>` folders, newest first (unverified)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p))
    return sorted(out, reverse=True)


def read_manifest(folder: Path) -> dict[str, Any]:
    mpath = folder / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{folder}: no {MANIFEST} (the save never committed)")
    try:
        manifest = json.loads(mpath.read_text())
    except ValueError:
        raise CheckpointError(f"{mpath}: not valid JSON") from None
    for key in ("mode", "step", "files", "world_size", "train_state"):
        if key not in manifest:
            raise CheckpointError(f"{mpath}: missing {key!r}")
    return manifest


def verify(folder: Path, checksums: bool = True) -> Checkpoint:
    """verify returns the checkpoint if every listed file has its size (and checksum).

    Raises CheckpointError naming the first file that does not.
    """
    manifest = read_manifest(folder)
    for name, meta in sorted(manifest["files"].items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != meta["size"]:
            raise CheckpointError(
                f"{path}: {size} bytes, manifest says {meta['size']} (truncated?)")
        if checksums and not checksum_ok(path, meta):
            kind = "sha256_tree" if "sha256_tree" in meta else "sha256"
            raise CheckpointError(f"{path}: {kind} does not match the manifest (corrupt)")
    return Checkpoint(folder, manifest)


def scan(root: Path, checksums: bool = True) -> Iterator[tuple[int, Path, Checkpoint | None, str]]:
    """scan yields (step, folder, checkpoint or None, problem) per step folder, newest first."""
    for step, folder in committed_steps(root):
        try:
            yield step, folder, verify(folder, checksums), ""
        except CheckpointError as exc:
            yield step, folder, None, str(exc)


def clean_uncommitted(root: Path) -> list[Path]:
    """clean_uncommitted removes temporary folders a killed save left behind; returns them."""
    removed = []
    if root.is_dir():
        for p in root.iterdir():
            if p.is_dir() and (p.name.startswith(".tmp-step-") or p.name.startswith(".old-step-")):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p)
    return removed
