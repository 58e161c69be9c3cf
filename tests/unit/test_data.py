"""The corpus and its order: deterministic, sharded without loss, resumable, world-size free."""

from __future__ import annotations

import json
import os
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from pyrecover.data import EOD, Batches, DataError, load_tokens
from pyrecover.datasource import prepare


def batches(n_windows=37, block=8, seed=3) -> Batches:
    tokens = torch.arange(n_windows * block + 1) % 256
    return Batches(tokens, block, seed)


def ids_of(step_batches) -> list[int]:
    """The window ids a rank received, recovered from the inputs' first token."""
    return [int(w) for x, _ in step_batches for w in x[:, 0]]


@pytest.mark.parametrize("world", [1, 2, 4])
def test_one_epoch_over_all_ranks_covers_every_window_exactly_once(world):
    per_step, b = 4, batches(n_windows=40)
    ranks = [batches(n_windows=40) for _ in range(world)]
    seen = []
    for _ in range(b.num_windows // per_step):
        for r, rb in enumerate(ranks):
            ids = rb.window_ids(rb.position + r * (per_step // world), per_step // world)
            rb.position += per_step
            seen += ids
    assert sorted(seen) == list(range(40))


def test_the_same_seed_gives_the_same_order_and_another_seed_another():
    a, b, c = batches(seed=1), batches(seed=1), batches(seed=2)
    assert a.window_ids(0, 100) == b.window_ids(0, 100)
    assert a.window_ids(0, 37) != c.window_ids(0, 37)


@pytest.mark.parametrize("seed", [0, 1337, 2**44, 2**63 - 1])
def test_every_seed_the_config_accepts_orders_the_windows(seed):
    """Up to 2**64 the generator gets seed * 1_000_003 + epoch, as before (a resumed run keeps
    its order); a seed above ~1.8e13 used to overflow it (a traceback at every start)."""
    b, again = batches(n_windows=37, seed=seed), batches(n_windows=37, seed=seed)
    order = b.window_ids(0, 74)
    assert sorted(order[:37]) == sorted(order[37:]) == list(range(37))
    assert order == again.window_ids(0, 74)
    if seed * 1_000_003 + 1 < 2**63:
        g = torch.Generator().manual_seed(seed * 1_000_003 + 1)
        assert order[37:] == torch.randperm(37, generator=g).tolist()


def test_each_epoch_is_a_new_permutation_of_all_windows():
    b = batches(n_windows=37)
    first, second = b.window_ids(0, 37), b.window_ids(37, 37)
    assert sorted(first) == sorted(second) == list(range(37))
    assert first != second


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_together_see_exactly_the_global_batch_of_one_process(world):
    ref = batches()
    ranks = [batches() for _ in range(world)]
    for _ in range(5):
        whole = ids_of(ref.next_global(8, 0, 1, 2))
        parts = [ids_of(rb.next_global(8, r, world, 2)) for r, rb in enumerate(ranks)]
        assert [i for p in parts for i in p] == whole
    assert {rb.position for rb in ranks} == {ref.position}


def test_a_resumed_iterator_continues_with_exactly_the_next_batches():
    run = batches()
    for _ in range(7):
        run.next_global(8, 1, 2, 2)
    resumed = batches()
    resumed.position = run.position
    for _ in range(9):
        assert ids_of(resumed.next_global(8, 1, 2, 2)) == ids_of(run.next_global(8, 1, 2, 2))


def test_targets_are_the_inputs_shifted_by_one_token():
    x, y = batches().windows([3, 5])
    assert x.shape == y.shape == (2, 8)
    assert torch.equal(x[:, 1:], y[:, :-1])


def write(path, table):
    pq.write_table(table, path)
    return path


def test_text_becomes_utf8_bytes_with_an_end_of_document_token(tmp_path):
    f = write(tmp_path / "t.parquet", pa.table({"text": ["hé", "", "ab"]}))
    assert load_tokens(f, "text").tolist() == [104, 0xC3, 0xA9, EOD, 97, 98, EOD]


def test_an_already_tokenized_list_column_is_used_as_is(tmp_path):
    f = write(tmp_path / "t.parquet", pa.table({"ids": [[1, 2, 3], [40000]]}))
    assert load_tokens(f, "ids").tolist() == [1, 2, 3, 40000]


@pytest.mark.parametrize("table", [
    pa.table({"text": ["hé", "", None, "ab", "c", "déf", "g"]}),
    pa.table({"ids": [[1, 2], [3], [], [4, 5, 6], [7], [8, 9], [10]]}),
])
def test_a_column_read_in_many_chunks_gives_the_tokens_of_one(tmp_path, table):
    """The column was made one array (combine_chunks) before reading it, whose 32-bit offsets
    a text corpus over 2 GiB overflows ('offset overflow'): it is read chunk by chunk now,
    and a file of many row groups must give exactly the tokens of a file of one."""
    whole = write(tmp_path / "one.parquet", table)
    parts = tmp_path / "many.parquet"
    pq.write_table(table, parts, row_group_size=2)
    name = table.column_names[0]
    assert pq.read_table(parts, columns=[name]).column(name).num_chunks > 1
    assert torch.equal(load_tokens(parts, name), load_tokens(whole, name))


@pytest.mark.skipif(not hasattr(pa, "string_view"), reason="pyarrow before 16 has no views")
def test_text_a_writer_stored_as_a_string_view_is_text(tmp_path):
    """Polars 1.38 writes its strings as Arrow's string_view, and pyarrow reads them back as
    such: a corpus built with it was refused as "expected a string"."""
    f = write(tmp_path / "t.parquet", pa.table({"text": pa.array(["hé", "ab"],
                                                                 pa.string_view())}))
    assert load_tokens(f, "text").tolist() == [104, 0xC3, 0xA9, EOD, 97, 98, EOD]


def test_a_fixed_length_token_list_column_is_used_as_is(tmp_path):
    """Hugging Face datasets store `Sequence(Value("int32"), length=N)`, the usual shape of a
    packed, pre-tokenized corpus, as a fixed-size list: it was refused as not a list."""
    f = write(tmp_path / "t.parquet", pa.table({"ids": pa.array([[1, 2, 3], [4, 5, 6]],
                                                                pa.list_(pa.int32(), 3))}))
    assert load_tokens(f, "ids").tolist() == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.write_bytes(b"not parquet at all"), "not a readable parquet file"),
    (lambda p: write(p, pa.table({"body": ["x"]})), "no column 'text' (data.column); it has: "
                                                    "body"),
    (lambda p: write(p, pa.table({"text": pa.array([], pa.string())})), "holds no tokens"),
    (lambda p: write(p, pa.table({"text": [1.5]})), "expected a string or a list of integers"),
    (lambda p: write(p, pa.table({"text": [[1, None, 3], None, [4]]})),
     "holds 1 missing (null) token ids"),
])
def test_unusable_corpora_get_one_clear_error(tmp_path, make, message):
    path = tmp_path / "c.parquet"
    make(path)
    with pytest.raises(DataError) as err:
        load_tokens(path, "text")
    assert message in str(err.value)


def test_a_corpus_shorter_than_one_window_is_refused():
    with pytest.raises(DataError, match="fewer than one window"):
        Batches(torch.arange(5), 8, 0)


def test_prepare_is_reproducible_and_keeps_sorted_file_order(tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "b.py").write_text("b = 2\n")
    (src / "pkg" / "a.py").write_text("a = 1\n")
    (src / "notes.txt").write_text("skipped\n")
    (src / "bad.py").write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / "elsewhere.py").write_text("secret = 1\n")
    (src / "link.py").symlink_to(tmp_path / "elsewhere.py")  # never followed out of src
    done = prepare(src, tmp_path / "one.parquet")
    assert done[:4] == (2, 12, 1, 1)
    assert done.summary("one.parquet") == ("wrote one.parquet: 2 files, 12 bytes of text "
                                           "(skipped: 1 not UTF-8 text, 1 symbolic link(s))")
    prepare(src, tmp_path / "two.parquet")
    one, two = pq.read_table(tmp_path / "one.parquet"), pq.read_table(tmp_path / "two.parquet")
    assert one.equals(two)
    assert one.column("path").to_pylist() == ["b.py", "pkg/a.py"]


def test_prepare_keeps_a_file_s_line_endings_as_they_are(tmp_path):
    # Text mode turned \r\n and a lone \r into \n: the corpus held other bytes than the files.
    src = tmp_path / "src"
    src.mkdir()
    (src / "dos.txt").write_bytes(b"one\r\ntwo\r\n")
    (src / "mac.txt").write_bytes(b"three\rfour")
    done = prepare(src, tmp_path / "c.parquet", (".txt",))
    texts = pq.read_table(tmp_path / "c.parquet").column("text").to_pylist()
    assert texts == ["one\r\ntwo\r\n", "three\rfour"]
    assert done.bytes == 20


def test_prepare_counts_and_limits_megabytes_not_characters(tmp_path):
    # The tokens are UTF-8 bytes: 1000 characters of "é" are 2000 of them, not 1000.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("é" * 1000, encoding="utf-8")
    (src / "b.txt").write_text("x" * 500, encoding="utf-8")
    assert prepare(src, tmp_path / "all.parquet", (".txt",)).bytes == 2500
    done = prepare(src, tmp_path / "cut.parquet", (".txt",), max_bytes=2400)
    assert (done.files, done.bytes) == (1, 2000)
    with pytest.raises(DataError, match="larger than the limit"):
        prepare(src, tmp_path / "none.parquet", (".txt",), max_bytes=1500)


def test_prepare_takes_a_file_whose_name_is_not_utf8(tmp_path):
    # Its name (the path column) was a UnicodeEncodeError traceback after reading every file.
    src = tmp_path / "src"
    src.mkdir()
    (src / "ok.txt").write_text("fine\n")
    with open(os.path.join(os.fsencode(src), b"caf\xe9.txt"), "w") as f:
        f.write("latin-1 name, utf-8 text\n")
    done = prepare(src, tmp_path / "c.parquet", (".txt",))
    table = pq.read_table(tmp_path / "c.parquet")
    assert done.files == 2
    assert table.column("path").to_pylist() == ["caf\\xe9.txt", "ok.txt"]
    assert table.column("text").to_pylist() == ["latin-1 name, utf-8 text\n", "fine\n"]


def test_prepare_counts_a_linked_folder_it_does_not_follow(tmp_path):
    # Its files were left out without a word: the summary counted linked files only.
    src, elsewhere = tmp_path / "src", tmp_path / "elsewhere"
    src.mkdir()
    elsewhere.mkdir()
    (src / "a.py").write_text("a = 1\n")
    (elsewhere / "b.py").write_text("b = 2\n")
    (src / "more").symlink_to(elsewhere)
    done = prepare(src, tmp_path / "c.parquet")
    assert (done.files, done.links) == (1, 1)
    assert done.summary("c.parquet").endswith("(skipped: 1 symbolic link(s))")


def test_prepare_takes_a_suffix_with_two_dots(tmp_path):
    # `--suffix .d.ts` matched nothing: a name's suffix is its last one only (".ts").
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.d.ts").write_text("declare const a: number;\n")
    (src / "b.ts").write_text("const b = 2;\n")
    prepare(src, tmp_path / "c.parquet", (".d.ts",))
    assert pq.read_table(tmp_path / "c.parquet").column("path").to_pylist() == ["a.d.ts"]


def test_prepare_refuses_to_write_inside_a_run_s_checkpoints_folder(tmp_path):
    # Retention deletes step folders, and a file there would change a committed checkpoint.
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("a = 1\n")
    run = tmp_path / "run"
    (run / "checkpoints" / "step-30").mkdir(parents=True)
    (run / "events.jsonl").write_text("")
    out = run / "checkpoints" / "step-30" / "x.parquet"
    with pytest.raises(DataError, match="inside the checkpoints folder of the run"):
        prepare(src, out)
    assert not out.exists()
    prepare(src, run / "data.parquet")  # beside them in the run directory is fine
    # A folder called checkpoints that is no run's is anybody's.
    prepare(src, tmp_path / "checkpoints" / "x.parquet")


def test_a_fingerprint_tells_another_corpus_and_only_another():
    from pyrecover.data import FINGERPRINT_SPAN, fingerprint

    tokens = torch.arange(1_000_003) % 257
    assert fingerprint(tokens) == fingerprint(tokens.clone())
    assert fingerprint(tokens)["tokens"] == 1_000_003
    for changed in (tokens[:-1], torch.cat([tokens, tokens[:1]]), tokens.roll(1)):
        assert fingerprint(changed) != fingerprint(tokens)
    edited = tokens.clone()
    edited[0] += 1  # the first span is always read, and so is the last
    assert fingerprint(edited) != fingerprint(tokens)
    edited = tokens.clone()
    edited[-1] += 1
    assert fingerprint(edited) != fingerprint(tokens)
    short = torch.arange(FINGERPRINT_SPAN // 2)  # shorter than one span: all of it
    assert fingerprint(short) != fingerprint(short.flip(0))


def test_a_corpus_record_binds_the_run_once_anything_under_checkpoints_may_be_resumed(
        tmp_path):
    from pyrecover.experiment import check_corpus, record_corpus
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    old, new = {"tokens": 10, "digest": "a"}, {"tokens": 10, "digest": "b"}
    record_corpus(run, old)
    assert check_corpus(run, new, "c.parquet") == new  # nothing trained on the old one yet
    record_corpus(run, new)
    assert check_corpus(run, new, "c.parquet") == new
    (run.checkpoints / ".snap-step-5").mkdir()  # memory mode's snapshot, made a step later
    with pytest.raises(DataError, match=r"c.parquet holds other data .*\(the same 10 tokens, "
                                        r"other text\)"):
        check_corpus(run, old, "c.parquet")
    record_corpus(run, old)  # a start that raced past the check does not rebind the run
    with pytest.raises(DataError, match="10 tokens then, 11 now"):
        check_corpus(run, {"tokens": 11, "digest": "b"}, "c.parquet")


@pytest.mark.parametrize("damaged", [b'{"tokens": 10, "dig', b"", b"\xff\xfe", b"[]",
                                     b'{"tokens": "10", "digest": "a"}',
                                     b'{"tokens": true, "digest": "a"}', b'{"tokens": 10}'],
                         ids=["torn", "empty", "not-utf8", "list", "str", "bool", "no-digest"])
def test_a_damaged_corpus_record_is_refused_not_taken_for_a_deleted_one(tmp_path, damaged):
    from pyrecover.experiment import check_corpus, record_corpus
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    now = {"tokens": 10, "digest": "a"}
    run.corpus.write_bytes(damaged)
    assert check_corpus(run, now, "c.parquet") == now  # nothing trained yet: nothing to lose
    (run.checkpoints / "step-2").mkdir()
    with pytest.raises(DataError, match=rf"^{re.escape(str(run.corpus))} is damaged \(.*\): .* "
                                        r"delete it to go on with c.parquet as it is now"):
        check_corpus(run, now, "c.parquet")  # the same data too: the record cannot say so
    record_corpus(run, now)
    assert run.corpus.read_bytes() == damaged  # left for the user to look at
    run.corpus.unlink()  # the user's word: go on with the data as it is now
    assert check_corpus(run, now, "c.parquet") == now
    record_corpus(run, now)
    assert json.loads(run.corpus.read_text()) == now


def test_an_unreadable_corpus_record_is_refused_and_a_record_is_replaced_whole(tmp_path):
    from pyrecover.experiment import check_corpus, record_corpus
    from pyrecover.rundir import RunDir

    run = RunDir(tmp_path / "run")
    run.create()
    now = {"tokens": 10, "digest": "a"}
    run.corpus.write_text("{}")
    record_corpus(run, now)  # no checkpoint yet: replaced, by a rename (never torn)
    assert json.loads(run.corpus.read_text()) == now
    assert sorted(p.name for p in run.root.iterdir() if "corpus" in p.name) == ["corpus.json"]
    run.corpus.unlink()
    run.corpus.mkdir()
    (run.checkpoints / "step-2").mkdir()
    with pytest.raises(DataError, match=r"is damaged \(cannot be read: Is a directory\)"):
        check_corpus(run, now, "c.parquet")


# Runs the CLI with at most 3 GiB of address space: a file read whole past that is a
# MemoryError where a bounded read is not.
BOUNDED = ("-c", "import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_AS, "
           "(3 << 30, 3 << 30)); sys.argv[0] = 'pyrecover'; "
           "runpy.run_module('pyrecover', run_name='__main__')")


@pytest.mark.parametrize("first", [False, True])
def test_prepare_stops_at_the_limit_without_reading_a_huge_file_whole(tmp_path, first):
    """`data prepare --max-mb 1` of a folder holding a 16 GB file read all of it before
    looking at the limit: a MemoryError traceback (or minutes of reading and swapping)."""
    from helpers import pyrecover

    src = tmp_path / "src"
    src.mkdir()
    if not first:
        (src / "a.txt").write_text("small\n")
    with open(src / "huge.txt", "wb") as f:  # sparse: 16 GB of NUL, valid UTF-8
        f.truncate(16 << 30)
    out = tmp_path / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out), "--suffix", ".txt", "--max-mb", "1",
                     via=BOUNDED)
    assert "Traceback" not in done.stderr
    if first:
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            f"error: the first file, {src / 'huge.txt'} ({(16 << 30) / 1e6:.3f} MB of text), "
            "is larger than the limit of 1 MB; raise the limit"]
        assert not out.exists()
    else:
        assert done.returncode == 0, done.stderr
        assert pq.read_table(out).column("text").to_pylist() == ["small\n"]


@pytest.mark.parametrize("limit", ["1e300", "1e308"])
def test_a_limit_larger_than_any_corpus_takes_every_file(tmp_path, limit):
    """--max-mb 1e308 was an OverflowError traceback (1e308 MB is an infinity of bytes), and
    1e300 one too once each file was read to the limit: such a limit is no limit."""
    from helpers import pyrecover

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("small\n")
    out = tmp_path / "c.parquet"
    done = pyrecover("data", "prepare", str(src), str(out), "--suffix", ".txt", "--max-mb",
                     limit)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert pq.read_table(out).column("text").to_pylist() == ["small\n"]
