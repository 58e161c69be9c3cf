"""The training corpus: parquet in, fixed-length token windows out, in a resumable order.

Tokens are bytes (0-255) with 256 ending each document, or the integers of an already
tokenized list column. The token stream is cut into windows of `block_size + 1` tokens. The
global order of windows is an endless stream: epoch e is a permutation of all windows drawn
from a generator seeded with (seed, e). A global batch is the next `global_batch_size`
windows of that stream and rank r takes its contiguous share, so the only position to save
is how many windows were consumed, and it means the same thing at every world size.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from pyrecover.datasource import DataError, check_source
from pyrecover.oneline import first_line

EOD = 256  # end-of-document token for byte-level text


def load_tokens(path: str | Path, column: str) -> torch.Tensor:
    """load_tokens reads the column and returns the whole corpus as one token tensor, in the
    narrowest of int16, int32 and int64 that holds every id (int16 for text: a quarter of
    int64's memory on every rank; the windows come out as int64 all the same).

    Chunk by chunk, as pyarrow reads it: one array of the whole column (combine_chunks) has
    32-bit offsets, which a text corpus over 2 GiB overflows."""
    check_source(path, column)
    p = Path(path)
    try:
        col = pq.read_table(p, columns=[column]).column(column)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{p}: cannot read column {column!r} ({first_line(exc)})") from None
    kind = col.type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or _is_string_view(kind):
        tokens = _join([_bytes_tokens(chunk) for chunk in col.chunks], np.int16)
    elif (pa.types.is_list(kind) or pa.types.is_large_list(kind)
          or pa.types.is_fixed_size_list(kind)) and pa.types.is_integer(kind.value_type):
        flat = [chunk.flatten() for chunk in col.chunks]
        nulls = sum(f.null_count for f in flat)
        if nulls:  # to_numpy would make it a NaN, then int64's minimum
            raise DataError(f"{p}: column {column!r} holds {nulls} missing (null) token ids; "
                            "fix the tokenization")
        ids = [f.to_numpy(zero_copy_only=False) for f in flat if len(f)]
        low = min((int(i.min()) for i in ids), default=0)
        top = max((int(i.max()) for i in ids), default=0)
        if top > 2**63 - 1:  # int64 would wrap it
            raise DataError(f"{p}: token id {top} is outside [0, model.vocab_size); fix the "
                            "tokenization")
        tokens = _join(ids, _narrowest(low, top))
    else:
        raise DataError(f"{p}: column {column!r} has type {kind}; expected a string or a list "
                        "of integers")
    if tokens.numel() == 0:
        raise DataError(f"{p}: column {column!r} holds no tokens")
    return tokens


def _narrowest(low: int, high: int) -> type:
    """_narrowest is the smallest signed integer type that holds every id in [low, high]
    (signed: torch's kernels cover them all, its unsigned types only some)."""
    for kind in (np.int16, np.int32):
        info = np.iinfo(kind)
        if info.min <= low and high <= info.max:
            return kind
    return np.int64


def _join(parts: list[np.ndarray], kind: type) -> torch.Tensor:
    """_join puts the chunks' tokens into one new tensor of `kind` (pyarrow's are read-only)."""
    out = _empty(sum(len(part) for part in parts), kind)
    at = 0
    for part in parts:
        out[at:at + len(part)] = part
        at += len(part)
    return torch.from_numpy(out)


def _empty(size: int, kind: type) -> np.ndarray:
    """_empty is numpy's view of a new torch tensor. numpy asks the kernel for huge pages for
    a large array (madvise), and where transparent huge pages defragment on demand the first
    touch of a few hundred MB stalled 1-3 s on a 2-core VM; torch's allocator does not ask."""
    return torch.empty(size, dtype=torch.from_numpy(np.empty(0, dtype=kind)).dtype).numpy()


def _is_string_view(kind: pa.DataType) -> bool:
    """Polars (1.38 on) writes strings as string_view, which pyarrow 16 on reads back as such."""
    return getattr(pa.types, "is_string_view", lambda _: False)(kind)


def check_tokens(tokens: torch.Tensor, vocab_size: int, block_size: int,
                 path: str | Path) -> None:
    """check_tokens refuses a corpus the model cannot train on: a token id outside
    [0, vocab_size) (an IndexError on every rank on CPU, a device-side assert on a GPU), or
    fewer tokens than one window. Run before anything is written."""
    low, high = int(tokens.min()), int(tokens.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise DataError(f"{path}: token id {bad} is outside [0, model.vocab_size={vocab_size}); "
                        "raise model.vocab_size or fix the tokenization")
    if (tokens.numel() - 1) // block_size < 1:
        raise DataError(f"{path}: corpus has {tokens.numel()} tokens, fewer than one window of "
                        f"model.block_size + 1 = {block_size + 1}")


FINGERPRINT_SPANS, FINGERPRINT_SPAN = 4096, 64  # 262144 tokens read at most


def fingerprint(tokens: torch.Tensor) -> dict[str, int | str]:
    """fingerprint names a corpus in milliseconds at any size: its token count and a digest of
    FINGERPRINT_SPANS runs of FINGERPRINT_SPAN tokens spread evenly over it. Another corpus at
    the same path (rebuilt, regenerated, re-tokenized) differs in one of them, or in length,
    unless it differs only between the spans."""
    n = tokens.numel()
    span = min(FINGERPRINT_SPAN, n)
    spans = max(1, min(FINGERPRINT_SPANS, n // max(span, 1)))
    starts = torch.arange(spans, dtype=torch.int64) * (n - span) // max(spans - 1, 1)
    sample = tokens.reshape(-1)[(starts[:, None] + torch.arange(span)).reshape(-1)]
    digest = hashlib.blake2b(sample.to(torch.int64).numpy().tobytes(), digest_size=16)
    return {"tokens": n, "digest": digest.hexdigest()}


def _bytes_tokens(col: pa.Array) -> np.ndarray:
    """_bytes_tokens is the UTF-8 bytes of every non-empty string, each followed by EOD, read
    from the column's own buffers: no Python string per document, no int64 copy."""
    col = col.cast(pa.large_string())  # int64 offsets, for string_view too
    if col.null_count:  # Arrow lets a null hold bytes: a copy without them
        col = col.drop_null()
    if len(col) == 0:
        return np.empty(0, dtype=np.int16)
    offsets = np.frombuffer(col.buffers()[1], dtype=np.int64)[col.offset:col.offset + len(col) + 1]
    keep = np.diff(offsets) > 0
    data = np.frombuffer(col.buffers()[2] or b"", dtype=np.uint8)[offsets[0]:offsets[-1]]
    stops = offsets[1:][keep] - offsets[0]
    ends = stops + np.arange(stops.size)  # where each document's EOD goes
    tokens = _empty(data.size + stops.size, np.int16)
    text = _empty(tokens.size, np.bool_)
    text[:] = True
    text[ends] = False
    tokens[ends] = EOD
    tokens[text] = data
    return tokens


@dataclass
class Batches:
    """Global batches of windows in a deterministic, resumable order.

    `position` counts windows consumed by all ranks together since the start of training.
    """

    tokens: torch.Tensor
    block_size: int
    seed: int
    position: int = 0

    def __post_init__(self) -> None:
        self.num_windows = (self.tokens.numel() - 1) // self.block_size
        if self.num_windows < 1:
            raise DataError(f"corpus has {self.tokens.numel()} tokens, fewer than one window of "
                            f"model.block_size + 1 = {self.block_size + 1}")
        self._epoch = -1
        self._perm = torch.empty(0, dtype=torch.int64)

    def window_ids(self, start: int, count: int) -> list[int]:
        """window_ids returns the ids at stream positions [start, start + count)."""
        ids = []
        for pos in range(start, start + count):
            epoch, index = divmod(pos, self.num_windows)
            ids.append(int(self._permutation(epoch)[index]))
        return ids

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            # Reduced to what a generator takes (2**64): the same order below that, and a
            # large train.seed no longer overflows.
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
            self._perm = torch.randperm(self.num_windows, generator=g)
            self._epoch = epoch
        return self._perm

    def windows(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """windows returns inputs and next-token targets for the given window ids."""
        starts = torch.tensor(ids, dtype=torch.int64) * self.block_size
        offsets = torch.arange(self.block_size + 1, dtype=torch.int64)
        chunk = self.tokens[starts[:, None] + offsets[None, :]].to(torch.int64)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def next_global(self, global_batch: int, rank: int, world_size: int,
                    micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """next_global takes this rank's share of the next global batch, as micro-batches.

        Every rank advances `position` by the whole global batch, so positions agree.
        """
        share = global_batch // world_size
        ids = self.window_ids(self.position + rank * share, share)
        self.position += global_batch
        return [self.windows(ids[i:i + micro_batch]) for i in range(0, share, micro_batch)]

    @property
    def epoch(self) -> int:
        return self.position // self.num_windows
