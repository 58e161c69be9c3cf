"""`pyrecover data prepare` given a bad source, destination or limit: one line, and the
corpus that was there kept."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
from helpers import pyrecover


def test_data_prepare_without_sources_is_a_clear_error(tmp_path):
    done = pyrecover("data", "prepare", str(tmp_path / "none"), str(tmp_path / "o.parquet"))
    assert done.returncode == 2
    assert "source folder" in done.stderr and "does not exist" in done.stderr


def test_data_prepare_from_an_empty_source_is_refused_not_the_current_folder(tmp_path):
    """`data prepare "$TEXTS" c.parquet` with the variable unset built a corpus of whatever
    the current folder held (as a Path, "" is "."), and trained on it without a word."""
    (tmp_path / "secret.py").write_text("password = 'x'\n")
    done = pyrecover("data", "prepare", "", "c.parquet", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: SRC_DIR is empty; give the folder of text files to read, e.g. ~/my-texts"]
    assert not (tmp_path / "c.parquet").exists()


def test_data_prepare_into_a_folder_or_an_unwritable_place_is_one_line_and_leaves_nothing(
        tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("print('hi')\n")
    for out, said in ((src, "is a folder; give the parquet file to write"),
                      (tmp_path / "not-a-dir" / "x" / "c.parquet", "is a file, not a folder")):
        if out != src:
            (tmp_path / "not-a-dir").write_text("a file where a folder should be")
        done = pyrecover("data", "prepare", str(src), str(out))
        assert done.returncode == 2, done.stderr
        assert done.stderr.startswith("error: ") and said in done.stderr, done.stderr
        assert len(done.stderr.splitlines()) == 1
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_data_prepare_under_a_file_says_so_not_that_the_file_exists(tmp_path):
    """`data prepare texts notes.txt/c.parquet` read every file, then said 'cannot write
    notes.txt/c.parquet: File exists' (mkdir's words for the parent that is a file)."""
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("print('hi')\n")
    (tmp_path / "notes.txt").write_text("a file where a folder should be")
    out = tmp_path / "notes.txt" / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out))
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        f"error: {out}: {tmp_path / 'notes.txt'} is a file, not a folder; choose a path under "
        "a folder"]


def test_data_prepare_on_a_full_disk_is_a_storage_fault_that_keeps_the_old_corpus(tmp_path):
    """A full disk is no mistake of the user's: exit 1 with a `storage:` line, as export and
    plot say it (it was exit 2), and the corpus already there stays whole."""
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text(os.urandom(50_000).hex())  # text no compression makes small
    out = tmp_path / "c.parquet"
    out.write_bytes(b"the old corpus")
    done = pyrecover("data", "prepare", str(src), str(out), "--force", max_file_bytes=4096)
    assert done.returncode == 1, done.stderr
    assert done.stderr.startswith(f"error: storage: cannot write {out}: "), done.stderr
    assert len(done.stderr.splitlines()) == 1
    assert out.read_bytes() == b"the old corpus"
    assert not [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]


def test_data_prepare_into_a_name_that_is_no_parquet_file_is_refused_before_reading(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("print('hi')\n")
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "corpus.txt"))
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {tmp_path / 'corpus.txt'} does not end in .parquet, and the corpus is written "
        f"as parquet; name it e.g. {tmp_path / 'corpus.parquet'}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["texts"]


def test_data_prepare_takes_a_suffix_with_or_without_its_dot(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.txt").write_text("hello\n")
    (src / "b.md").write_text("# hi\n")
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "c.parquet"),
                     "--suffix", "txt", "--suffix", ".md")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(tmp_path / "c.parquet")["path"].to_pylist() == ["a.txt", "b.md"]


def test_data_prepare_replaces_an_existing_corpus_only_with_force(tmp_path):
    """A run trained on the old file would resume on the new one without a word."""
    src, out = tmp_path / "texts", tmp_path / "c.parquet"
    src.mkdir()
    (src / "a.py").write_text("print('new')\n")
    out.write_bytes(b"the old corpus")
    done = pyrecover("data", "prepare", str(src), str(out))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "already exists; pass --force" in done.stderr
    assert out.read_bytes() == b"the old corpus"
    done = pyrecover("data", "prepare", str(src), str(out), "--force")
    assert done.returncode == 0, done.stderr
    assert pq.read_table(out)["text"].to_pylist() == ["print('new')\n"]


def test_a_limit_smaller_than_the_first_file_says_so(tmp_path):
    src = tmp_path / "texts"
    src.mkdir()
    (src / "a.py").write_text("x = 1\n" * 400)
    done = pyrecover("data", "prepare", str(src), str(tmp_path / "c.parquet"), "--max-mb",
                     "0.001")
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "a.py (0.002 MB of text), is larger than the limit of 0.001 MB" in done.stderr
