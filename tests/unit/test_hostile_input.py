"""Hostile or broken input: one line, exit 2, nothing written, and never a huge message."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import TINY, files_under, pyrecover

from pyrecover import config as config_mod
from pyrecover.config import ConfigError

BOMB = """lol0: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
lol1: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
lol2: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
lol3: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
lol4: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
lol5: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
lol6: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
lol7: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
run: {exp_name: *h}
"""


def test_a_yaml_alias_bomb_is_refused_at_once_with_a_short_message(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(BOMB)
    # Refused at its first alias (line 2), so nothing was expanded: no clock needed.
    with pytest.raises(ConfigError, match="line 2: YAML aliases") as info:
        config_mod.load(path)
    assert len(str(info.value)) < 300


def test_an_oversized_config_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text("run:\n  exp_name: x\n" + "#" * (2 << 20))
    with pytest.raises(ConfigError, match="a config file is at most"):
        config_mod.load(path)


@pytest.mark.parametrize("text, message", [
    ("run: {exp_name: x}\n1: 2\n", "key 1 under top level is not a name"),
    ("train: {seed: 1, 2: 3}\n", "key 2 under train is not a name"),
    ("train: {lr: " + "9" * 400 + "}\n", "train.lr=" ),
    ("train: {beta1: 1.0}\n", "train.beta1=1.0 is not allowed: expected 0 <= value < 1"),
    ("train: {beta2: -0.1}\n", "train.beta2=-0.1 is not allowed"),
    ("train: {seed: 9223372036854775808}\n", "train.seed=9223372036854775808 is not allowed"),
    ("train: {seed: " + "9" * 30 + "}\n", "expected a 64-bit integer"),
    ("train: {weight_decay: -1}\n", "train.weight_decay=-1.0 is not allowed: expected >= 0"),
    ("model: {block_size: 100000000}\n", "model.block_size=100000000 is not allowed"),
    ("model: {vocab_size: 4000000000}\n", "model.vocab_size=4000000000 is not allowed"),
    ("run: {exp_name: [" + "1," * 5000 + "]}\n", "<a list of 5000 items>"),
    ("run: {exp_name: " + "x" * 5000 + "}\n", "... (5000 characters)"),
    ("train:\n  lr: 1.0e-3\n  lr: 2.0e-3\n", "c.yaml line 3: key 'lr' appears twice in one "
                                             "mapping; keep one"),
    ("train: {lr: 0.1}\ntrain: {seed: 1}\n", "line 2: key 'train' appears twice"),
    ("train: 0\n", "train must be a mapping, got 0"),
    ("train: []\n", "train must be a mapping, got []"),
    ("0\n", "expected a mapping of sections, got int"),
    ("~: a\nnull: b\n", "line 2: key 'null' appears twice"),
    ("train: {seed: 1, 1.0: 2, 1: 3}\n", "key '1' appears twice"),
])
def test_each_bad_value_is_one_short_line_naming_the_key(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        config_mod.load(path)
    assert message in str(info.value) and len(str(info.value)) < 300, str(info.value)


def test_a_section_with_every_key_commented_out_is_its_defaults_and_takes_set(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  # lr: 0.5\nmodel: {n_layer: 2}\n")
    cfg = config_mod.load(path, ["train.seed=7"])
    assert (cfg.train.seed, cfg.train.lr, cfg.model.n_layer) == (7, 1e-3, 2)


def test_a_merge_key_is_no_duplicate_and_may_be_overridden(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train: {<<: {lr: 0.01, seed: 3}, seed: 4}\n")
    cfg = config_mod.load(path)
    assert (cfg.train.lr, cfg.train.seed) == (0.01, 4)


def write_corpus(folder, ids):
    pq.write_table(pa.table({"ids": pa.array(ids, type=pa.list_(pa.int64()))}),
                   folder / "tok.parquet")


@pytest.mark.parametrize("setup, args, message", [
    (lambda d: (d / "x.yaml").write_bytes(b"run:\n  exp_name: caf\xe9\n"),
     ["--config", "x.yaml"], "not UTF-8 text (byte 0xe9 at offset 20)"),
    (lambda d: (d / "x.yaml").write_text(BOMB), ["--config", "x.yaml"], "YAML aliases"),
    (lambda d: write_corpus(d, [[1, 2, 3] * 100, [5, 400, 7] * 50]),
     ["--config", str(TINY), "--set", "data.path=tok.parquet", "--set", "data.column=ids"],
     "tok.parquet: token id 400 is outside [0, model.vocab_size=320)"),
    (lambda d: write_corpus(d, [[1, -3, 3] * 100]),
     ["--config", str(TINY), "--set", "data.path=tok.parquet", "--set", "data.column=ids"],
     "token id -3 is outside"),
    (lambda d: pq.write_table(pa.table({"ids": pa.array([[1, 2, 3] * 100 + [2**64 - 1]],
                                                        type=pa.list_(pa.uint64()))}),
                              d / "tok.parquet"),
     ["--config", str(TINY), "--set", "data.path=tok.parquet", "--set", "data.column=ids"],
     "token id 18446744073709551615 is outside"),
    (lambda d: write_corpus(d, [[1, 2, 3]]),
     ["--config", str(TINY), "--set", "data.path=tok.parquet", "--set", "data.column=ids"],
     "fewer than one window"),
])
def test_bad_input_to_train_is_one_line_exit_2_before_anything_is_written(tmp_path, setup, args,
                                                                          message):
    setup(tmp_path)
    before = files_under(tmp_path)
    done = pyrecover("train", *args, "--set", f"run.storage={tmp_path / 'store'}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert files_under(tmp_path) == before


def test_a_corpus_error_with_two_local_ranks_is_said_once_and_writes_nothing(tmp_path):
    write_corpus(tmp_path, [[1, 2, 3]])
    done = pyrecover("train", "--nproc", "2", "--config", str(TINY), "--set",
                     "data.path=tok.parquet", "--set", "data.column=ids", "--set",
                     f"run.storage={tmp_path / 'store'}", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("error: ") == 1 and "fewer than one window" in done.stderr
    assert not (tmp_path / "store").exists()


def test_a_path_under_the_home_folder_written_with_a_tilde_is_read_from_there(tmp_path):
    """`data.path: ~/corpus.parquet` in a YAML file (or `--set`, where the shell does not expand
    it) was said not to exist, and `run.storage: ~/runs` made a folder named `~` in the working
    directory."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    write_corpus(home, [list(range(1, 300))])
    done = pyrecover("train", "--config", str(TINY), "--set", "data.path=~/tok.parquet",
                     "--set", "data.column=ids", "--set", "run.storage=~/runs", "--set",
                     "train.max_steps=1", env={"HOME": str(home)}, cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (home / "runs" / "tiny" / "checkpoints" / "step-1").is_dir()
    assert files_under(work) == []


def test_a_run_dir_written_with_a_tilde_is_under_the_home_folder(tmp_path, corpus):
    """`--run-dir=~/runs/a` (bash expands no tilde after `--run-dir=`) trained into a folder
    named `~` in the working directory, where data.path and run.storage take it as home."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    done = pyrecover("train", "--config", str(TINY), "--set", f"data.path={corpus}", "--set",
                     "train.max_steps=1", "--run-dir=~/runs/a", env={"HOME": str(home)},
                     cwd=work)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (home / "runs" / "a" / "checkpoints" / "step-1").is_dir()
    assert files_under(work) == []


def test_a_demo_workdir_written_with_a_tilde_is_under_the_home_folder(tmp_path, monkeypatch):
    """`demo --workdir=~/d` made a folder `~/d` in the working directory for the corpus, then
    failed to write it there ("storage: cannot write ~/d/stdlib.parquet: ... /home/u/d/...")."""
    from typer.testing import CliRunner

    from pyrecover.cli import app
    from pyrecover.cli import demo as demo_mod

    seen = []
    monkeypatch.setattr(demo_mod, "run", lambda workdir, nproc: seen.append(workdir) or 0)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["demo", "--workdir=~/d"])
    assert result.exit_code == 0, result.output
    assert seen == [tmp_path / "home" / "d"]


def test_a_config_written_with_a_tilde_is_read_from_the_home_folder(tmp_path):
    """`--config=~/exp.yaml` (bash expands no tilde after `--config=`) was said not to exist."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "exp.yaml").write_text("train:\n  lr: -1\n")
    done = pyrecover("train", "--config=~/exp.yaml", env={"HOME": str(home)}, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("error: train.lr=-1.0 is not allowed: expected a learning "
                                   "rate > 0")
