"""Single-process training runs: the guard rails a user relies on between resumes."""

from __future__ import annotations

import json

import pytest
import yaml
from helpers import TINY, pyrecover, tiny_args

from pyrecover.rundir import read_jsonl


def train(tmp_path, corpus, *extra, name="run"):
    return pyrecover("train", *tiny_args(tmp_path, corpus, name, *extra))


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_diverging_run_stops_with_one_clear_line_and_records_it(tmp_path, corpus, nproc):
    """Every rank stops at the same step; rank 0 alone says why (a job of 512 ranks printed
    the line 512 times)."""
    done = pyrecover("train", "--nproc", str(nproc), *tiny_args(
        tmp_path, corpus, "run", "train.lr=1e12", "train.min_lr=0", "train.warmup_steps=0",
        "train.max_bad_steps=3"))
    assert done.returncode == 2
    said = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and said[0].startswith(
        "error: 3 consecutive steps had a non-finite loss"), done.stderr
    events = [e["event"] for e in read_jsonl(tmp_path / "run" / "events.jsonl")
              if e["event"] != "phase"]  # phases.py: the exit phase comes after the error
    assert events.count("bad_step") == 3 and events[-1] == "error"


def test_non_finite_steps_are_skipped_and_counted_in_the_checkpoints_that_follow(
        tmp_path, corpus):
    """The fused optimizer skips a NaN step on the device and the host reads the step later
    (loop.py); a checkpoint still holds the count of bad steps in a row up to its own step."""
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=12",
                                         "train.log_interval=100", "checkpoint.interval=3",
                                         "checkpoint.keep=4"),
                     env={"PYRECOVER_NAN_AT_STEPS": "2,3,7,9"})
    assert done.returncode == 0, done.stderr
    run = tmp_path / "run"
    assert [e["step"] for e in read_jsonl(run / "events.jsonl")
            if e["event"] == "bad_step"] == [2, 3, 7, 9]
    saved = {int(p.parent.name.split("-")[1]): json.loads(p.read_text())["train_state"]
             for p in (run / "checkpoints").glob("step-*/manifest.json")}
    assert {s: t["bad_steps"] for s, t in saved.items()} == {3: 2, 6: 0, 9: 1, 12: 0}


def test_restarting_with_a_different_model_is_refused_and_changes_nothing(tmp_path, corpus):
    assert train(tmp_path, corpus, "train.max_steps=10").returncode == 0
    recorded = (tmp_path / "run" / "run.yaml").read_text()
    done = train(tmp_path, corpus, "model.n_layer=3")
    assert done.returncode == 2
    assert "was started with another config (model.n_layer: 2 -> 3)" in done.stderr
    assert (tmp_path / "run" / "run.yaml").read_text() == recorded


def test_a_refused_restart_of_local_workers_is_one_line_from_rank_0_and_every_rank_ends(
        tmp_path, corpus):
    """Rank 0 refused alone, before the group was up, and the others then sat retrying its
    store for over a minute and ended in C++ stack frames."""
    first = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.max_steps=4"),
                      "--nproc", "2")
    assert first.returncode == 0, first.stderr
    recorded = (tmp_path / "run" / "run.yaml").read_text()
    done = pyrecover("train", *tiny_args(tmp_path, corpus, "run", "train.seed=7"), "--nproc",
                     "2")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: {tmp_path / 'run'} was started with another config "
                      "(train.seed: 1337 -> 7); use a new run.exp_name (--set run.exp_name=NAME), "
                      "or restore the old values"], done.stderr
    assert "TCPStore" not in done.stderr and "frame #" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert (tmp_path / "run" / "run.yaml").read_text() == recorded


def test_raising_max_steps_continues_the_finished_run(tmp_path, corpus):
    assert train(tmp_path, corpus, "train.max_steps=10").returncode == 0
    done = train(tmp_path, corpus, "train.max_steps=20")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stderr and "(step 10," in done.stderr
    steps = [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert steps == list(range(1, 21))


def test_a_restart_with_another_lr_weight_decay_or_betas_trains_with_them(tmp_path, corpus):
    """Loading the checkpoint restored the old values: a raised lr was ignored (the schedule
    kept the old base lr, with the new min_lr / lr floor: the run ended 10x below min_lr)."""
    import torch

    new = ("train.lr=1e-2", "train.min_lr=1e-3", "train.weight_decay=0.5", "train.beta2=0.9")
    assert train(tmp_path, corpus, "train.max_steps=10").returncode == 0
    done = train(tmp_path, corpus, "train.max_steps=20", *new)
    assert done.returncode == 0, done.stderr
    assert "from step 10 on: train.lr: 0.001 -> 0.01; train.weight_decay: 0.1 -> 0.5; " \
        "train.beta2: 0.95 -> 0.9; the schedule's lr at step 11: " in done.stderr
    assert "(the config's, not the checkpoint's)" in done.stderr
    fresh = train(tmp_path, corpus, "train.max_steps=20", *new, name="fresh")
    assert fresh.returncode == 0, fresh.stderr
    lrs = {m["step"]: m["lr"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")}
    want = {m["step"]: m["lr"] for m in read_jsonl(tmp_path / "fresh" / "metrics.jsonl")}
    assert [lrs[s] for s in range(11, 21)] == [want[s] for s in range(11, 21)]  # its schedule
    groups = torch.load(tmp_path / "run" / "checkpoints" / "step-20" / "state.pt",
                        weights_only=True)["optimizer"]["param_groups"]
    assert [(g["weight_decay"], tuple(g["betas"])) for g in groups] == [
        (0.5, (0.9, 0.9)), (0.0, (0.9, 0.9))]  # norms and biases stay without decay
    again = train(tmp_path, corpus, "train.max_steps=25", *new)  # only the schedule's length
    assert again.returncode == 0 and "train.lr:" not in again.stderr, again.stderr
    assert "from step 20 on: the schedule's lr at step 21: 0.001 -> " in again.stderr
    lrs = [m["lr"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")][-5:]
    assert lrs == sorted(lrs, reverse=True) and lrs[0] > 1e-3, lrs  # no step back at min_lr


def test_a_start_refused_for_a_data_error_is_an_attempt_of_its_own(tmp_path, corpus):
    """The job script reads the error record to tell a config or data error from a crash;
    it comes after the start's own start-up phases, so status counts it as its own start
    instead of the end of the finished attempt before it."""
    import shutil

    data = tmp_path / "corpus.parquet"
    shutil.copy(corpus, data)
    assert train(tmp_path, data, "train.max_steps=4").returncode == 0
    data.write_bytes(b"not parquet")
    done = train(tmp_path, data, "train.max_steps=8")
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    tail = [(e["event"], e.get("phase")) for e in read_jsonl(tmp_path / "run" / "events.jsonl")]
    # Said before torch was imported (experiment.check_data_early): no imports_done phase.
    assert tail[-2:] == [("phase", "process_start"), ("error", None)]
    state = json.loads(pyrecover("status", str(tmp_path / "run"), "--json").stdout)
    assert state["starts"] == 2 and state["restarts_by_cause"] == {
        "continued after finishing": 1}, state
    assert state["last_error"].startswith("DataError"), state


@pytest.mark.parametrize("keep", [2, 3])
def test_only_the_newest_keep_checkpoints_stay_on_disk(tmp_path, corpus, keep):
    done = train(tmp_path, corpus, "train.max_steps=25", "checkpoint.interval=5",
                 f"checkpoint.keep={keep}")
    assert done.returncode == 0, done.stderr
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert kept == sorted(f"step-{s}" for s in (25, 20, 15)[:keep])


def test_other_data_at_the_same_path_is_refused_until_the_user_says_to_go_on(tmp_path, corpus):
    """A rebuilt corpus at data.path would take the run's saved data position into other
    text: the resume is refused in one line, recorded as the start's error (the job script
    does not requeue it), and goes on once the user deletes the record it names."""
    import shutil

    from helpers import build_corpus

    data = tmp_path / "corpus.parquet"
    shutil.copy(corpus, data)
    first = train(tmp_path, data, "train.max_steps=4", "checkpoint.interval=2")
    assert first.returncode == 0, first.stderr
    again = train(tmp_path, data, "train.max_steps=6", "checkpoint.interval=2")
    assert again.returncode == 0, again.stderr  # the same file: resumed
    build_corpus(data, max_bytes=300_000)  # the start of the same sources, but shorter
    done = train(tmp_path, data, "train.max_steps=8", "checkpoint.interval=2")
    assert done.returncode == 2, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {data} holds other data than this run's checkpoints")
    assert str(tmp_path / "run" / "corpus.json") in line
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["event"] != "phase"]
    assert events[-1]["event"] == "error" and "other data" in events[-1]["error"]
    (tmp_path / "run" / "corpus.json").unlink()
    resumed = train(tmp_path, data, "train.max_steps=8", "checkpoint.interval=2")
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoints/step-6 (step 6, 0 steps redone" in resumed.stderr, resumed.stderr
    assert (tmp_path / "run" / "corpus.json").is_file()


def test_a_torn_corpus_record_is_refused_not_taken_for_a_deleted_one(tmp_path, corpus):
    """Deleting corpus.json is how the user says to go on with other data; a torn or damaged
    one is not that word: the resume is refused in one line that names the file, on other
    data and on the same data alike (the record can no longer tell them apart), and the file
    is left as it was."""
    import shutil

    from helpers import build_corpus

    data = tmp_path / "corpus.parquet"
    shutil.copy(corpus, data)
    first = train(tmp_path, data, "train.max_steps=4", "checkpoint.interval=2")
    assert first.returncode == 0, first.stderr
    record = tmp_path / "run" / "corpus.json"
    was = json.loads(record.read_text())
    torn = record.read_text()[:len('{"tokens": , "dig') + len(str(was["tokens"]))]
    record.write_text(torn)  # as a copy or a sync cut short leaves it
    for swap in (False, True):
        if swap:
            build_corpus(data, max_bytes=300_000)  # other data at the same path
        done = train(tmp_path, data, "train.max_steps=8", "checkpoint.interval=2")
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
        line = done.stderr.strip()
        assert line.startswith(f"error: {record} is damaged ("), line
        assert f"delete it to go on with {data} as it is now" in line, line
        assert record.read_text() == torn
        assert not (tmp_path / "run" / "checkpoints" / "step-6").exists()
    record.unlink()
    resumed = train(tmp_path, data, "train.max_steps=6", "checkpoint.interval=2")
    assert resumed.returncode == 0, resumed.stderr
    assert "checkpoints/step-4 (step 4, 0 steps redone" in resumed.stderr, resumed.stderr
    assert json.loads(record.read_text())["tokens"] < was["tokens"]  # the new data, recorded


def test_run_yaml_restarts_the_run_from_any_folder_and_names_where_it_lives(tmp_path, corpus):
    """run.yaml recorded data.path as typed (relative), so `--config run.yaml` from another
    folder looked for the data there; and a first start with --run-dir recorded the config's
    run.exp_name and run.storage, not the folder it ran in."""
    import shutil

    here = tmp_path / "here"
    (here / "data").mkdir(parents=True)
    shutil.copy(corpus, here / "data" / "c.parquet")
    first = pyrecover("train", "--config", str(TINY), "--run-dir", str(tmp_path / "runs" / "a"),
                      "--set", "data.path=data/c.parquet", "--set", "train.max_steps=3",
                      cwd=here)
    assert first.returncode == 0, first.stderr
    recorded = yaml.safe_load((tmp_path / "runs" / "a" / "run.yaml").read_text())
    assert recorded["run"] == {**recorded["run"], "storage": str(tmp_path / "runs"),
                               "exp_name": "a"}
    assert recorded["data"]["path"] == str(here / "data" / "c.parquet")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    again = pyrecover("train", "--config", str(tmp_path / "runs" / "a" / "run.yaml"), "--set",
                      "train.max_steps=6", cwd=elsewhere)
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stderr and not list(elsewhere.iterdir())
