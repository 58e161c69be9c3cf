"""The corpus file itself: is it there, is it parquet, has it the column. No torch here, so a
launcher (`train --nproc`, `bench memory`) checks the data before it starts any worker without
paying torch's import; data.py builds the token stream from it.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class DataError(ValueError):
    """The corpus cannot be used: missing, unreadable, empty or without the configured column."""


def check_source(path: str | Path, column: str) -> pa.Schema:
    """check_source raises DataError unless `path` is a readable parquet with `column`.

    Reads only the footer, so a launcher can check before it starts any worker.
    """
    p = Path(path)
    if not p.is_file():
        what = "is a folder, not a parquet file" if p.is_dir() else "does not exist"
        raise DataError(f"data file {str(p)!r} {what}; build one with "
                        "`pyrecover data prepare SRC_DIR OUT.parquet`")
    try:
        schema = pq.read_schema(p)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{p}: not a readable parquet file ({first_line(exc)})") from None
    if column not in schema.names:
        raise DataError(f"{p}: no column {column!r} (data.column); it has: "
                        + ", ".join(schema.names))
    return schema


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
