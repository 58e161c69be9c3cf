"""`train.global_batch_size: auto`: the global batch a run trains with at each world size."""

from __future__ import annotations

import os
import shutil

import pytest

from pyrecover import batch, config
from pyrecover.config import ConfigError
from pyrecover.experiment import prepare_run_dir, resolve_for_run
from pyrecover.rundir import RunDir


@pytest.mark.parametrize("value, micro, world, expected", [
    # auto:N keeps N wherever it splits into world size x micro batch ...
    ("auto:16", 8, 1, 16), ("auto:16", 8, 2, 16), ("auto:16", 4, 4, 16), ("auto:16", 2, 8, 16),
    ("auto:256", 16, 8, 256), ("auto:256", 16, 16, 256),
    # ... and otherwise takes the nearest multiple, never less than one micro batch per rank
    ("auto:16", 8, 8, 64), ("auto:16", 8, 4, 32), ("auto:16", 8, 3, 24),
    ("auto:100", 8, 8, 128), ("auto:200", 8, 8, 192), ("auto:20", 2, 3, 18),
    ("auto:96", 8, 8, 64),  # a tie: the smaller one
    ("auto:256", 16, 12, 192), ("auto:128", 4, 6, 120),
    # auto: one micro batch per rank
    ("auto", 8, 1, 8), ("auto", 8, 8, 64), ("auto", 3, 5, 15),
    # a number is exact, as before
    (16, 8, 2, 16), (64, 8, 8, 64),
])
def test_the_global_batch_for_each_world_size_and_micro_batch(value, micro, world, expected):
    size, note = batch.resolve_global_batch(value, micro, world)
    assert size == expected
    assert size % (world * micro) == 0
    if isinstance(value, int):
        assert note is None
    else:
        assert note is not None and f": {expected} sequences" in note and "\n" not in note
        assert ("kept" in note) == (value == f"auto:{expected}")


def test_a_fixed_global_batch_that_does_not_split_is_refused_and_auto_is_suggested():
    with pytest.raises(ConfigError, match=r"8 x 8 = 64\), or auto:16"):
        batch.resolve_global_batch(16, 8, 8)


@pytest.mark.parametrize("value", ["automatic", "auto:", "auto:0", "auto:-4", "16 seqs", 0])
def test_bad_global_batch_values_are_one_line_naming_the_key(value):
    with pytest.raises(ConfigError, match="train.global_batch_size") as err:
        config.load(None, [f"train.global_batch_size={value}"])
    assert "\n" not in str(err.value)


def test_an_auto_run_keeps_its_recorded_batch_on_resume_or_is_refused():
    assert batch.resolve_global_batch("auto:16", 8, 4, recorded=64)[0] == 64  # 4 x 8 x 2
    with pytest.raises(ConfigError, match="recorded 64 in run.yaml"):
        batch.resolve_global_batch("auto:16", 8, 3, recorded=64)


def test_the_defaults_run_at_any_world_size_and_run_yaml_records_what_was_chosen(tmp_path):
    cfg = config.load(None, [f"run.storage={tmp_path}"])
    for world in (1, 2, 3, 4, 8, 16):
        size, _ = batch.resolve_global_batch(cfg.train.global_batch_size,
                                             cfg.train.micro_batch_size, world)
        assert size % (world * cfg.train.micro_batch_size) == 0

    resolved, note = resolve_for_run(cfg, 8)
    run = RunDir(resolved.run_dir())
    prepare_run_dir(resolved, run, note)
    text = run.config.read_text()
    assert text.startswith("# train.global_batch_size=auto:16: 64 sequences chosen")
    assert config.load(run.config).train.global_batch_size == 64
    # Launching the same run again at world size 4 keeps 64; at 3 it is refused.
    assert resolve_for_run(cfg, 4)[0].train.global_batch_size == 64
    with pytest.raises(ConfigError, match="keeps its global batch"):
        resolve_for_run(cfg, 3)


def test_a_restart_with_new_limits_records_them_and_keeps_the_rest_as_recorded(tmp_path,
                                                                             monkeypatch):
    """Raising train.max_steps to continue a finished run (as the README says to) left the
    old limit in run.yaml, so status showed `step 70 of 60`; a path given relative now and
    absolute before, and the note of an `auto` batch, stay as recorded."""
    cfg = config.load(None, [f"run.storage={tmp_path}", "train.max_steps=60"])
    resolved, note = resolve_for_run(cfg, 8)
    run = RunDir(resolved.run_dir())
    prepare_run_dir(resolved, run, note)
    first = run.config.read_text()
    prepare_run_dir(resolved, run, None)  # the same again: run.yaml untouched
    assert run.config.read_text() == first
    data = os.path.abspath(cfg.data.path)  # recorded absolute; from here, relative is another
    monkeypatch.chdir(tmp_path)
    more, _ = resolve_for_run(config.load(None, ["run.storage=.", "train.max_steps=70",
                                                 f"data.path={data}"]), 8)
    prepare_run_dir(more, run, None)
    text = run.config.read_text()
    recorded = config.load(run.config)
    assert recorded.train.max_steps == 70 and recorded.run.storage == str(tmp_path)
    assert text.splitlines()[0] == first.splitlines()[0] and text.startswith("# train.")
    assert text.replace("max_steps: 70", "max_steps: 60") == first
    # A restart with --run-dir and another config's run.storage and run.exp_name: the job
    # script restarts with `--config run.yaml` alone, which must still point here.
    elsewhere, _ = resolve_for_run(config.load(None, [
        "run.storage=/elsewhere", "run.exp_name=other", "train.max_steps=80",
        f"data.path={data}"]), 8)
    prepare_run_dir(elsewhere, run, None)
    recorded = config.load(run.config)
    assert recorded.train.max_steps == 80 and recorded.run_dir() == run.root
    # A run moved (or copied) to another folder: its run.yaml names the new place.
    moved = RunDir(tmp_path / "moved" / "copy")
    moved.root.parent.mkdir()
    shutil.copytree(run.root, moved.root)
    prepare_run_dir(elsewhere, moved, None)
    assert config.load(moved.config).run_dir() == moved.root
    assert config.load(run.config).run_dir() == run.root
