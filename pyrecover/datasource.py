"""The corpus file itself: built from text files (`pyrecover data prepare`), and checked: is it
there, is it parquet, has it the column. No torch here, so a launcher (`train --nproc`, `bench
memory`) checks the data before it starts any worker, and `data prepare` runs, without paying
torch's import; data.py builds the token stream from it.
"""

from __future__ import annotations

import codecs
import contextlib
import os
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq

from pyrecover.config_schema import DataConfig
from pyrecover.oneline import first_line, not_a_file
from pyrecover.rundir import storage_error


class DataError(ValueError):
    """The corpus cannot be used: missing, unreadable, empty or without the configured column."""


def check_source(path: str | Path, column: str) -> pa.Schema:
    """check_source raises DataError unless `path` is a readable parquet with `column`.

    Reads only the footer, so a launcher can check before it starts any worker.
    """
    p = Path(path)
    if not p.is_file():
        demo = " (`pyrecover demo` builds this default one)" if str(path) == DataConfig.path else ""
        raise DataError(f"data file {str(p)!r} {not_a_file(p, 'a parquet file')}; build one with "
                        f"`pyrecover data prepare SRC_DIR OUT.parquet`{demo}")
    try:
        schema = pq.read_schema(p)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{p}: not a readable parquet file ({first_line(exc)})") from None
    if column not in schema.names:
        raise DataError(f"{p}: no column {column!r} (data.column); it has: "
                        + ", ".join(schema.names))
    return schema


# What `prepare` may name its output: a parquet file, said so by its name.
PARQUET_SUFFIXES = (".parquet", ".pq")


class Cut(NamedTuple):
    """The files a size limit left out: how many, the first (in the corpus's order), and
    the limit in bytes."""

    files: int
    first: str
    limit: int


class Prepared(NamedTuple):
    """What `prepare` wrote, and what it left out."""

    files: int
    bytes: int
    not_utf8: int = 0  # files that are not UTF-8 text
    links: int = 0  # symbolic links, never followed (as rglob follows no linked folder)
    cut: Cut | None = None  # the files the limit left out
    unreadable: int = 0  # files it could not read (permissions, I/O errors)

    def summary(self, out: str | Path) -> str:
        """summary is the line `data prepare` and the demo print."""
        skipped = [f"{n} {what}" for n, what in ((self.not_utf8, "not UTF-8 text"),
                                                 (self.unreadable, "unreadable"),
                                                 (self.links, "symbolic link(s)")) if n]
        notes = [f"skipped: {', '.join(skipped)}"] if skipped else []
        if self.cut is not None:
            notes.append(f"the limit of {self.cut.limit / 1e6:g} MB left out "
                         f"{_count(self.cut.files, 'file')}, from {self.cut.first} on")
        return (f"wrote {out}: {_count(self.files, 'file')}, {amount(self.bytes)} of text"
                + (f" ({'; '.join(notes)})" if notes else ""))


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def amount(size: int) -> str:
    """amount is a size of text for people: a 12-byte corpus is "12 bytes", not "0.0 MB"
    (decimal units, as --max-mb's)."""
    if size < 1000:
        return _count(size, "byte")
    return f"{size / 1e3:.1f} kB" if size < 999_950 else f"{size / 1e6:.1f} MB"


def _matches(path: Path, suffixes: tuple[str, ...]) -> bool:
    """_matches says whether `path` ends in one of `suffixes`: its last suffix, or a longer
    ending such as .d.ts (Path.suffix is .ts there)."""
    return path.suffix in suffixes or any(
        s.count(".") > 1 and path.name.endswith(s) for s in suffixes)


READ_CHUNK = 1 << 24  # bytes: a limit far above any file asks for no buffer of its size


def _read(path: Path, limit: int | None) -> tuple[bytes, int | None]:
    """_read is the file's bytes and None, or where it holds more than `limit` bytes, its
    first ones and its size (at least limit + 1): never more than the limit and a byte are
    read, so a huge file past the limit costs no time and no memory."""
    with path.open("rb") as f:
        if limit is None:
            return f.read(), None
        limit = max(0, limit)
        chunks, got = [], 0
        while got <= limit:
            chunk = f.read(min(limit + 1 - got, READ_CHUNK))
            if not chunk:
                return b"".join(chunks), None
            chunks.append(chunk)
            got += len(chunk)
        return b"".join(chunks), max(got, os.fstat(f.fileno()).st_size)


def prepare(src_dir: str | Path, out: str | Path, suffixes: tuple[str, ...] = (".py",),
            max_bytes: int | None = None, replace: bool = True) -> Prepared:
    """prepare writes one row per text file under src_dir into a parquet `text` column.

    Files are taken in sorted path order, so the corpus is the same on every machine with the
    same sources; files that are not UTF-8 and symbolic links (which may point anywhere) are
    skipped and counted. An existing `out` is replaced only with `replace` (`data prepare
    --force`). Returns what it wrote.
    """
    src = Path(src_dir)
    if not src.is_dir():
        what = "is not a folder" if src.exists() else "does not exist"
        raise DataError(f"source folder {str(src)!r} {what}")
    out_path = Path(out)
    if out_path.is_dir():
        raise DataError(f"{out_path} is a folder; give the parquet file to write, e.g. "
                        f"{out_path / 'corpus.parquet'}")
    # said before reading: mkdir would say "File exists" of a parent that is a file
    above = next(p for p in Path(os.path.abspath(out_path)).parents
                 if p.exists() or p.is_symlink())
    if not above.is_dir():
        what = "a file" if above.exists() else "a broken symbolic link"
        raise DataError(f"{out_path}: {above} is {what}, not a folder; choose a path under a "
                        "folder")
    if out_path.name.lower() in PARQUET_SUFFIXES:  # Path(".parquet").suffix is ""
        raise DataError(f"{out_path} is a file ending alone (a hidden file); name the corpus, "
                        f"e.g. {out_path.with_name('corpus.parquet')}")
    if out_path.suffix.lower() not in PARQUET_SUFFIXES:  # out.PARQUET is one too
        raise DataError(f"{out_path} does not end in .parquet, and the corpus is written as "
                        f"parquet; name it e.g. {out_path.with_name(out_path.stem + '.parquet')}")
    run = next((p.parent for p in Path(os.path.abspath(out_path)).resolve().parents
                if p.name == "checkpoints" and (p.parent / "events.jsonl").is_file()), None)
    if run is not None:
        raise DataError(f"{out_path} is inside the checkpoints folder of the run {run}, which "
                        "holds checkpoints only (retention deletes step folders); choose a "
                        "path outside it")
    if not replace and out_path.is_file():
        raise DataError(f"{out} already exists; pass --force to replace it (a run trained on "
                        "it would then resume on other data)")
    paths, texts, total = [], [], 0
    not_utf8 = unreadable = links = 0
    too_big: tuple[Path, int] | None = None  # the file the limit stopped at
    later: list[Path] = []  # and the paths after it
    found = sorted(src.rglob("*"))
    for i, path in enumerate(found):
        link = path.is_symlink()
        # a linked folder is counted whatever its name: rglob does not go into it
        if suffixes and not _matches(path, suffixes) and not (link and path.is_dir()):
            continue
        if link:
            links += 1
            continue
        if not path.is_file():
            continue
        try:
            # bytes, then decoded: read_text's text mode would turn \r\n and \r into \n;
            # megabytes of UTF-8, as the tokens are bytes: not characters
            raw, size = _read(path, None if max_bytes is None else max_bytes - total)
            if size is not None:  # past the limit: what was read must still be UTF-8 text
                codecs.getincrementaldecoder("utf-8")().decode(raw, final=False)
                too_big = (path, size)
                later = found[i + 1:]  # files it would have taken: said, not read
                break
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            not_utf8 += 1
            continue
        except OSError:  # said apart: a file it may not read is no encoding problem
            unreadable += 1
            continue
        if not text:
            continue
        paths.append(_name(path.relative_to(src)))
        texts.append(text)
        total += len(raw)
    if not texts and too_big is not None:
        raise DataError(f"the first file, {too_big[0]} ({too_big[1] / 1e6:.3f} MB of text), is "
                        f"larger than the limit of {max_bytes / 1e6:g} MB; raise the limit")
    if not texts:
        kinds = "/".join(s or "suffix-less" for s in suffixes)
        raise DataError(f"no readable {kinds} files under {src}")
    out_path = Path(out)
    tmp = out_path.with_name(f".{out_path.name}.tmp-{os.getpid()}")
    try:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"path": paths, "text": texts}), tmp)
        os.replace(tmp, out_path)
    except OSError as exc:  # say where, no traceback, nothing half-written left
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        if isinstance(exc, (PermissionError, IsADirectoryError, NotADirectoryError,
                            FileExistsError)):  # the user's path: exit 2
            raise DataError(f"cannot write {out_path}: {exc.strerror or exc}") from None
        # A full disk, a quota, an I/O error: the storage's fault (exit 1), as other writes.
        raise storage_error("write", out_path, exc) from None
    cut = None
    if too_big is not None and max_bytes is not None:
        left = 1 + sum(1 for p in later if (not suffixes or _matches(p, suffixes))
                       and not p.is_symlink() and p.is_file())
        cut = Cut(left, _name(too_big[0].relative_to(src)), max_bytes)
    return Prepared(len(texts), total, not_utf8, links, cut, unreadable)


def _name(path: Path) -> str:
    """_name is a path as the corpus's path column holds it: a name that is not UTF-8 (parquet
    strings are) keeps its odd bytes as \\xNN."""
    return os.fsencode(path).decode("utf-8", "backslashreplace")
