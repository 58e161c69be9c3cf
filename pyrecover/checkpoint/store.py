"""The commit protocol every checkpoint mode shares, and reading committed checkpoints back.

A checkpoint is committed by: write every file into `checkpoints/.tmp-step-<N>-<id>/`, fsync
each file and the folder, write `manifest.json` last (mode, step, world size, train state,
each file's size and checksum), rename the folder to `step-<N>/` and fsync `checkpoints/`.
A folder without a manifest whose files all verify does not exist for the loader.

Each file's checksum is one of checksum.py's kinds (`CHECKSUM_KINDS`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from pyrecover.checkpoint import entries, trust
from pyrecover.checkpoint.checksum import (  # noqa: F401 (callers know them as store.*)
    CHECKSUM_KINDS,
    TREE_BLOCK,
    TREE_KIND,
    TREE_KINDS,
    block_digest,
    sha256_file,
    tree_digest,
    tree_file,
)
from pyrecover.rundir import RunDir

MANIFEST = "manifest.json"
SNAPSHOT_GLOB = ".snap-step-*"  # memory mode's survivors' snapshots (layout.py's SNAP_PREFIX)
FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder and the file."""


class Unreadable(CheckpointError):
    """A checkpoint's files could not be read (EIO, ESTALE, EACCES): skipped like a corrupt
    one, but no proof that it is bad, so a start that finds no other does not start over."""


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


def checksum_kind(meta: dict[str, Any]) -> str:
    """checksum_kind names the checksum a manifest entry carries (a CheckpointError if none)."""
    for kind in CHECKSUM_KINDS:
        if kind in meta:
            return kind
    raise CheckpointError(f"no checksum this version knows in {sorted(meta)}; expected one "
                          f"of {', '.join(CHECKSUM_KINDS)} (written by a newer pyrecover?)")


def checksum_ok(path: Path, meta: dict[str, Any]) -> bool:
    """checksum_ok compares a file with its manifest entry, whichever checksum it has."""
    kind = checksum_kind(meta)
    actual = sha256_file(path) if kind == "sha256" else tree_file(path, kind)
    return actual == meta[kind]


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
               extra: dict[str, Any] | None = None, keep_replaced: bool = False) -> Path:
        """commit writes the manifest last, renames into `step-<N>/` and returns that folder.
        An older `step-<N>/` it replaces is kept as `invalid-step-<N>-*` where it does not
        verify by its sizes, or where `keep_replaced` says its checksums did not (the
        resume's finding, which a size check cannot repeat)."""
        manifest = {
            "format": FORMAT, "mode": mode, "step": self.step, "world_size": world_size,
            "time": time.time(), "train_state": train_state, "files": self.files,
            **trust.record(self.tmp, list(self.files)), **(extra or {}),
        }
        mpath = self.tmp / MANIFEST
        with mpath.open("w") as f:
            json.dump(manifest, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(self.tmp)
        final = self.root / step_folder_name(self.step)
        if final.exists() or final.is_symlink():
            # An older save of the same step (a resume that redid it) is replaced: renamed
            # aside first so one of the two is always whole. One that does not verify (which
            # is why the resume went back past it) is kept for inspection as `invalid-step-*`.
            try:
                verify(final, checksums=False)
                keep = keep_replaced
            except CheckpointError:
                keep = True
            aside = self.root / (f"invalid-step-{self.step}-{uuid.uuid4().hex[:8]}" if keep
                                 else f".old-step-{self.step}-{uuid.uuid4().hex[:8]}")
            os.rename(final, aside)
            os.rename(self.tmp, final)
            if not keep:
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
    checked: str = "checksums"  # or "sizes", or "same-job record" (trust.py)

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    @property
    def mode(self) -> str:
        return str(self.manifest["mode"])

    @property
    def size(self) -> int:
        return sum(int(f["size"]) for f in self.manifest["files"].values())


def step_folder_name(step: int) -> str:
    return f"step-{step}"


def committed_steps(root: Path) -> list[tuple[int, Path]]:
    """committed_steps lists `step-<N>` folders, newest first (unverified; a symlink too, which
    verify then refuses)."""
    out = []
    if root.is_dir():
        for p in root.iterdir():
            digits = p.name[5:]  # ASCII only: int() cannot read every digit isdigit() knows
            if p.name.startswith("step-") and digits.isascii() and digits.isdigit() and (
                    entries.is_dir_or_link(p)):
                out.append((int(digits), p))
    return sorted(out, reverse=True)


# What a manifest of each mode must list (the files a restore opens first): a manifest whose
# mode disagrees with its files is invalid before anything is loaded.
MODE_FILES = {"vanilla": ("state.pt",), "dcp": (".metadata", "extra.json"), "memory": ("meta-r",)}


def _mode_problem(mode: str, names: list[str]) -> str:
    if mode not in MODE_FILES:
        return f"mode {mode!r} is not one this version knows ({', '.join(MODE_FILES)})"
    for need in MODE_FILES[mode]:
        if not any(n == need or (need.endswith("-r") and n.startswith(need)) for n in names):
            return f"mode {mode!r}, but the manifest lists no {need}{'*' * need.endswith('-r')}"
    return ""


def plain_name_problem(name: object) -> str:
    """plain_name_problem is "" for a plain file name (no folder part, not `.`/`..`), else why
    not: a manifest only names files inside its own folder."""
    if not isinstance(name, str) or not name:
        return f"file name {name!r} is not a non-empty string"
    if "/" in name or "\\" in name or "\0" in name or name in (".", "..") or name == MANIFEST:
        return f"file name {name!r} is not a plain file name inside the checkpoint folder"
    return ""


def _structure_problem(manifest: object, folder: Path) -> str:
    """_structure_problem is "" when a manifest has the shape this version writes, else what
    is wrong with it."""
    if not isinstance(manifest, dict):
        return f"is a JSON {type(manifest).__name__}, not an object"
    for key in ("mode", "step", "files", "world_size", "train_state"):
        if key not in manifest:
            return f"missing {key!r}"
    step, world, files = manifest["step"], manifest["world_size"], manifest["files"]
    if not isinstance(manifest["mode"], str):
        return f"'mode' is {manifest['mode']!r}, not a name"
    if type(step) is not int or folder.name != step_folder_name(step):
        return f"'step' is {step!r}, but the folder is {folder.name} (copied in from elsewhere?)"
    if type(world) is not int or world < 1:
        return f"'world_size' is {world!r}, not a positive integer"
    if not isinstance(manifest.get("time", 0.0), (int, float)):
        return "'time' is not a number"
    if not isinstance(manifest["train_state"], dict):
        return "'train_state' is not an object"
    if not isinstance(files, dict) or not files:
        return "'files' is not an object naming at least one file"
    for name, meta in files.items():
        if problem := plain_name_problem(name):
            return problem
        if not isinstance(meta, dict):
            return f"the entry of {name!r} is not an object"
        if type(meta.get("size")) is not int or meta["size"] < 0:
            return f"the entry of {name!r} has no size in bytes"
        if not any(isinstance(meta.get(kind), str) for kind in CHECKSUM_KINDS):
            return (f"the entry of {name!r} has no checksum this version knows (one of "
                    f"{', '.join(CHECKSUM_KINDS)}; written by a newer pyrecover?)")
    return _mode_problem(manifest["mode"], list(files))


def step_folder(run: RunDir, step: int) -> Path:
    """step_folder is the folder of checkpoint `step` of `run`, or a CheckpointError naming the
    steps it has where there is none (unverified: a symlink too, which verify then refuses)."""
    folder = run.checkpoints / step_folder_name(step)
    if not entries.is_dir_or_link(folder):
        have = ", ".join(str(s) for s, _ in committed_steps(run.checkpoints)) or "none"
        raise CheckpointError(f"{run.root} has no checkpoint step {step} (steps: {have})")
    return folder


def read_manifest(folder: Path) -> dict[str, Any]:
    """read_manifest returns a step folder's manifest once its structure is valid (the files
    themselves are `verify`'s)."""
    if entries.is_link(folder):
        raise CheckpointError(f"{folder}: is a symbolic link; a checkpoint folder must be a "
                              f"real folder")
    mpath = folder / MANIFEST
    if not entries.is_file(mpath):  # a link is no manifest either
        raise CheckpointError(f"{folder}: no {MANIFEST} (the save never committed)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise CheckpointError(f"{mpath}: not valid JSON") from None
    if problem := _structure_problem(manifest, folder):
        raise CheckpointError(f"{mpath}: {problem}")
    return manifest


def verify(folder: Path, checksums: bool = True,
           environ: Mapping[str, str] | None = None) -> Checkpoint:
    """verify returns the checkpoint if every listed file has its size (and checksum).

    Raises CheckpointError naming the first file that does not, or what is wrong with the
    manifest. A listed file must be a regular file in the folder, not a symbolic link. With
    `environ` (a resume's), files the same job recorded and nobody touched since keep their
    checksum from the commit (trust.py).
    """
    try:
        return _verify(folder, checksums, environ)
    except OSError as exc:  # the storage's fault, not the checkpoint's (or not known to be)
        where = exc.filename or folder
        raise Unreadable(f"{where}: could not be read ({type(exc).__name__}: "
                         f"{exc.strerror or exc})") from None


def _verify(folder: Path, checksums: bool, environ: Mapping[str, str] | None) -> Checkpoint:
    manifest = read_manifest(folder)
    same_job = trust.trusted(folder, manifest, environ) if checksums else set()
    for name, meta in sorted(manifest["files"].items()):
        path = folder / name
        try:
            st = path.lstat()
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file (a symbolic link?); refused")
        if st.st_size != meta["size"]:
            raise CheckpointError(
                f"{path}: {st.st_size} bytes, manifest says {meta['size']} (truncated?)")
        if checksums and name not in same_job and not checksum_ok(path, meta):
            raise CheckpointError(
                f"{path}: {checksum_kind(meta)} does not match the manifest (corrupt)")
    checked = ("same-job record" if same_job >= set(manifest["files"]) else "checksums"
               ) if checksums else "sizes"
    return Checkpoint(folder, manifest, checked)


def scan(root: Path, checksums: bool = True, environ: Mapping[str, str] | None = None,
         steps: set[int] | None = None) -> Iterator[tuple[int, Path, Checkpoint | None, str]]:
    """scan yields (step, folder, checkpoint or None, problem) per step folder, newest first,
    of `steps` only where given, unread otherwise (`environ`: see verify)."""
    for step, folder in committed_steps(root):
        if steps is not None and step not in steps:
            continue
        try:
            yield step, folder, verify(folder, checksums, environ), ""
        except CheckpointError as exc:
            yield step, folder, None, str(exc)
