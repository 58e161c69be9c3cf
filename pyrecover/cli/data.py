"""`pyrecover data ...`: build a training corpus."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from pyrecover.cli.errors import PathText, finite, user_error

data_app = typer.Typer(help="Build training corpora (parquet files of text) from folders of files.",
                       no_args_is_help=True)


@data_app.command("prepare", short_help="Build a parquet corpus from a folder of text files.")
def prepare(
    src_dir: Annotated[PathText, typer.Argument(
        parser=str, help="Folder of text files, searched recursively.")],
    out: Annotated[PathText, typer.Argument(  # text: an empty one is not the Path '.'
        parser=str,
        help="Parquet file to write (a `text` column), ending in .parquet.")],
    suffix: Annotated[list[str] | None, typer.Option(
        help="File endings to take (.txt or txt); repeatable. Default: .py")] = None,
    max_mb: Annotated[float | None, typer.Option(callback=finite,
        min=0.001, help="Stop after this many megabytes of text.")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="Replace OUT where it exists (a run trained on it would then resume "
        "on other data).")] = False,
) -> None:
    """Build a parquet corpus, one row per file, in sorted path order (reproducible).

    \b
    Examples:
      pyrecover data prepare ~/my-texts corpus.parquet --suffix .txt --suffix .md
      pyrecover data prepare /usr/lib/python3.11 runs/stdlib.parquet --max-mb 2
    """
    from pyrecover import datasource

    if not src_dir.strip():  # `"$TEXTS"` unset: as a Path, "" is the current folder
        raise user_error("SRC_DIR is empty; give the folder of text files to read, e.g. "
                         "~/my-texts")
    if not out.strip():
        raise user_error("OUT is empty; give the parquet file to write, e.g. corpus.parquet")
    pattern = next((s for s in suffix or [] if any(c in s for c in "*?[")), None)
    if pattern is not None:  # as `ls *.txt` has it: no name ends in ".*.txt"
        raise user_error(f"--suffix={pattern!r} is a pattern; give the file ending itself, "
                         f"e.g. --suffix {Path(pattern).suffix or '.txt'}")
    listed = next((s for s in suffix or [] if re.search(r"[,\s]", s)), None)
    if listed is not None:  # no name ends in ".txt,.py": it reads as a list, and is none
        endings = " ".join(f"--suffix {e if e.startswith('.') else '.' + e}"
                           for e in re.split(r"[,\s]+", listed) if e)
        raise user_error(f"--suffix={listed!r} is not one file ending; give each ending its "
                         f"own option: {endings or '--suffix .txt'}")
    # `--suffix txt` means `.txt`: Path.suffix, which it is matched against, has the dot
    suffixes = tuple(s if s.startswith(".") or not s else f".{s}" for s in suffix or [".py"])
    # (a limit past any file's size, 1e308 MB an infinity of bytes, is none)
    max_bytes = int(min(max_mb * 1e6, sys.maxsize)) if max_mb is not None else None
    typer.echo(datasource.prepare(src_dir, out, suffixes, max_bytes, replace=force).summary(out))
