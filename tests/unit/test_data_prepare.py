"""`data prepare`'s summary line: how much it took, and what a --max-mb limit left out."""

from __future__ import annotations

import pytest

from pyrecover.datasource import prepare


@pytest.mark.parametrize("size, said", [(1, "1 byte"), (12, "12 bytes"), (2_500, "2.5 kB"),
                                        (999_999, "1.0 MB"), (5_200_000, "5.2 MB")])
def test_the_summary_says_a_small_corpus_s_size_in_a_unit_that_shows_it(tmp_path, size, said):
    """A 12-byte corpus was '0.0 MB of text': as if nothing had been written."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x" * size)
    done = prepare(src, tmp_path / "c.parquet", (".txt",))
    plural = "" if done.files == 1 else "s"
    assert done.summary("c.parquet") == f"wrote c.parquet: 1 file{plural}, {said} of text"


def test_a_limit_that_takes_every_file_says_nothing_of_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x" * 600)
    done = prepare(src, tmp_path / "c.parquet", (".txt",), max_bytes=600)
    assert done.summary("c.parquet") == "wrote c.parquet: 1 file, 600 bytes of text"
