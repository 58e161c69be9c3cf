"""`data prepare`'s summary line: how much it took, and what a --max-mb limit left out."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from helpers import pyrecover

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


def test_data_prepare_says_which_files_the_limit_left_out(tmp_path):
    """--max-mb stopped at the limit without a word: the summary read as if every file was in."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for name in ("a.txt", "b.txt", "sub/c.txt", "sub/d.txt"):
        (src / name).write_text("x" * 600)
    (src / "e.md").write_text("not asked for")
    out = tmp_path / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out), "--suffix", ".txt",
                     "--max-mb", "0.0015")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        f"wrote {out}: 2 files, 1.2 kB of text (the limit of 0.0015 MB left out 2 files, "
        "from sub/c.txt on)"]
    assert pq.read_table(out).column("path").to_pylist() == ["a.txt", "b.txt"]


def test_a_limit_that_takes_every_file_says_nothing_of_one(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("x" * 600)
    done = prepare(src, tmp_path / "c.parquet", (".txt",), max_bytes=600)
    assert done.summary("c.parquet") == "wrote c.parquet: 1 file, 600 bytes of text"


@pytest.mark.parametrize("given", ["*.txt", "a?.txt", "[ab].txt"])
def test_a_suffix_given_as_a_pattern_is_one_line_naming_the_ending(tmp_path, given):
    """--suffix '*.txt', as `ls *.txt` would have it, said 'no readable .*.txt files': no
    file's name ends in '.*.txt', and nothing said that the option takes an ending."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    out = tmp_path / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out), "--suffix", given)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --suffix={given!r} is a pattern; give the file ending itself, e.g. "
        "--suffix .txt"]
    assert not out.exists()


def test_a_file_it_may_not_read_is_counted_as_unreadable_not_as_not_utf8(tmp_path):
    """A colleague's file without read permission was summed up as '1 not UTF-8 text':
    the user looked for an encoding problem in a file that was plain text."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    (src / "b.txt").write_text("private\n")
    (src / "b.txt").chmod(0)
    (src / "c.txt").write_bytes(b"\xff\xfe")
    out = tmp_path / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out), "--suffix", ".txt",
                     file_permissions=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        f"wrote {out}: 1 file, 6 bytes of text (skipped: 1 not UTF-8 text, 1 unreadable)"]


@pytest.mark.parametrize("given", [".txt,.py", ".txt .py", "txt, py,"])
def test_several_endings_in_one_suffix_are_one_line_saying_to_give_each_its_own(tmp_path, given):
    """--suffix .txt,.py said 'no readable .txt,.py files under src' of a folder holding
    a.txt and b.py: read as if both endings had been looked for."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    (src / "b.py").write_text("b = 1\n")
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "c.parquet"), "--suffix", given)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --suffix={given!r} is not one file ending; give each ending its own "
        "option: --suffix .txt --suffix .py"]


@pytest.mark.parametrize("name", ["c.PARQUET", "c.Parquet", "c.PQ"])
def test_a_parquet_ending_in_capitals_is_written(tmp_path, name):
    """out.PARQUET was refused: 'does not end in .parquet ... name it e.g. out.parquet'."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("a = 1\n")
    done = pyrecover("data", "prepare", str(src), str(tmp_path / name))
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / name).column("path").to_pylist() == ["a.py"]


@pytest.mark.parametrize("name", [".parquet", ".PQ"])
def test_an_ending_alone_is_one_line_that_asks_for_a_name(tmp_path, name):
    """`data prepare src .parquet` said: name it e.g. .parquet.parquet."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("a = 1\n")
    done = pyrecover("data", "prepare", str(src), f"out/{name}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: out/{name} is a file ending alone (a hidden file); name the corpus, e.g. "
        "out/corpus.parquet"]
    assert not (tmp_path / "out").exists()


def test_the_readme_s_corpus_lines_build_the_demo_s_corpus_and_say_to_skip_it_after_the_demo():
    """The local-cluster walk-through built runs/stdlib.parquet with --max-mb 2: typed after
    `make demo` (the quick start's first command) it was refused as an existing file (exit 2),
    and typed before it, the demo trained on 2 MB where the README says 5."""
    import re
    from pathlib import Path

    from pyrecover.cli.demo import CORPUS_MAX_BYTES

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    lines = [line for line in readme.splitlines()
             if "data prepare" in line and "runs/stdlib.parquet" in line]
    assert lines
    for line in lines:
        limit = re.search(r"--max-mb (\S+)", line)
        assert limit and float(limit.group(1)) * 1e6 == CORPUS_MAX_BYTES, line
        assert "skip where `make demo` ran" in line, line
