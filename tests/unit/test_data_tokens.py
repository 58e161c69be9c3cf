"""The corpus in memory: the same tokens as the text says, in the narrowest integer type.

Every rank holds the whole corpus, so its type is the memory a run needs per process: text
is held as int16 (a quarter of int64), token ids in the narrowest type that holds them, and
the windows a step trains on are int64 whatever the corpus is held in."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pyrecover.data import EOD, Batches, load_tokens

ALPHABET = ["a", "Z", " ", "\n", "é", "€", "😀", "\x00"]


def expected_tokens(docs: list[str | None]) -> list[int]:
    """What the README promises: each non-empty document's UTF-8 bytes, then EOD."""
    out: list[int] = []
    for doc in docs:
        if doc:
            out += list(doc.encode("utf-8")) + [EOD]
    return out


def random_docs(rng: random.Random) -> list[str | None]:
    def doc() -> str | None:
        pick = rng.random()
        if pick < 0.1:
            return None
        if pick < 0.2:
            return ""
        return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 40)))
    return [doc() for _ in range(rng.randint(1, 30))]


def write_chunked(path, docs: list[str | None], kind: pa.DataType, rng: random.Random) -> None:
    """The documents in row groups of random sizes, so the column is read in several chunks."""
    table = pa.table({"text": pa.array(docs, type=kind)})
    pq.write_table(table, path, row_group_size=rng.randint(1, len(docs)))


@pytest.mark.parametrize("seed", range(40))
def test_text_is_its_utf8_bytes_and_an_end_token_per_document_held_as_int16(tmp_path, seed):
    rng = random.Random(seed)
    docs = random_docs(rng)
    docs.append("x")  # at least one token
    kinds = [pa.string(), pa.large_string()]
    if hasattr(pa, "string_view"):
        kinds.append(pa.string_view())
    path = tmp_path / "corpus.parquet"
    write_chunked(path, docs, rng.choice(kinds), rng)
    tokens = load_tokens(path, "text")
    assert tokens.tolist() == expected_tokens(docs)
    assert tokens.dtype == torch.int16


def test_a_sliced_arrow_chunk_gives_only_its_own_documents(tmp_path):
    """A chunk that is a slice of a larger buffer (offset > 0) starts at its own first byte."""
    docs = ["first", None, "second", "", "third"]
    whole = pa.array(docs * 3)
    pq.write_table(pa.Table.from_arrays([whole.slice(5, 5)], names=["text"]),
                   tmp_path / "c.parquet")
    assert load_tokens(tmp_path / "c.parquet", "text").tolist() == expected_tokens(docs)


@pytest.mark.parametrize(("ids", "dtype"), [
    ([0, 1, 2, 32767], torch.int16),
    ([0, 1, 32768], torch.int32),  # GPT-2's 50257 ids
    ([0, 2**31 - 1], torch.int32),
    ([0, 2**31], torch.int64),
    ([-1, 5], torch.int16),  # held as they are; check_tokens refuses them with a clear line
])
def test_token_ids_are_held_in_the_narrowest_type_that_keeps_every_id(tmp_path, ids, dtype):
    path = tmp_path / "ids.parquet"
    pq.write_table(pa.table({"ids": pa.array([ids[:1], ids[1:]], type=pa.list_(pa.int64()))}),
                   path)
    tokens = load_tokens(path, "ids")
    assert tokens.tolist() == ids
    assert tokens.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.int16, torch.int32])
def test_windows_are_int64_and_the_same_whatever_type_holds_the_corpus(dtype):
    wide = torch.randint(0, 300, (5000,), generator=torch.Generator().manual_seed(3))
    held = Batches(wide.to(dtype), block_size=16, seed=5)
    plain = Batches(wide, block_size=16, seed=5)
    for _ in range(40):  # past an epoch: every window once at least
        pairs = zip(held.next_global(8, 0, 1, 4), plain.next_global(8, 0, 1, 4), strict=True)
        for (x, y), (px, py) in pairs:
            assert x.dtype == y.dtype == torch.int64
            assert torch.equal(x, px) and torch.equal(y, py)
