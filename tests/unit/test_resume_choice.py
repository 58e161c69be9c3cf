"""Rank 0's choice of the checkpoint to resume, begun in the background while the model is
built (resume.choose_in_background): it picks what the plain pass picks, the resume uses that
pick and reports what it skipped once, a same-job vanilla file is read ahead into the page
cache, and a resume that restores nothing puts back what it must and says so."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from pathlib import Path

import pytest
import torch

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, resume, store
from pyrecover.rundir import RunDir, read_jsonl

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def outside_slurm(monkeypatch):
    """Outside SLURM every pick reads its checksums (trust.py), wherever the tests run."""
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST"):
        monkeypatch.delenv(name, raising=False)


def saved_run(tmp_path, flip: bool = True):
    """A run directory with vanilla checkpoints at steps 2 and 4 of one small state (other
    weights at each); with `flip`, step 4's file has one byte flipped after its commit."""
    src = build_state(400_000, seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    saver = CheckpointManager(run, "vanilla", 2, 3, 0, 1, src.parts, CPU, False)
    saver.at_step(2)
    with torch.no_grad():
        for p in src.parts.model.parameters():
            p.add_(1.0)
    saver.at_step(4)
    saver.finish(4)
    if flip:
        state = run.checkpoints / "step-4" / "state.pt"
        data = bytearray(state.read_bytes())
        data[len(data) // 2] ^= 0xFF
        state.write_bytes(bytes(data))
    return run


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))


def test_the_pick_begun_in_the_background_is_the_plain_pick(tmp_path):
    run = saved_run(tmp_path)
    plain = resume.choose(run.checkpoints, None, run.event)
    early = resume.choose_in_background(run.checkpoints, run.event).result(timeout=60)
    for choice in (plain, early):
        assert choice.found is not None and choice.found.step == 2
        assert choice.found.checked == "checksums"
        assert [(step, "corrupt" in problem) for step, _, problem in choice.invalid] == [(4, True)]


def test_a_resume_restores_the_early_pick_and_reports_the_skipped_one_once(tmp_path):
    run = saved_run(tmp_path)
    dst = build_state(400_000, seed=1)
    loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, dst.parts, CPU, False)
    loader.chosen = resume.choose_in_background(run.checkpoints, run.event)
    found = loader.resume(keep_weights=False)
    assert found is not None and found[0].step == 2
    assert same_weights(dst.parts.model, build_state(400_000, seed=0).parts.model)
    invalid = [e for e in read_jsonl(run.events) if e["event"] == "checkpoint_invalid"]
    assert [e["step"] for e in invalid] == [4]


def test_the_resume_takes_the_pick_it_is_given_rather_than_choosing_again(tmp_path):
    run = saved_run(tmp_path, flip=False)  # a fresh pass would choose step 4
    given: Future = Future()
    given.set_result(resume.Choice(store.verify(run.checkpoints / "step-2"),
                                   [(4, run.checkpoints / "step-4", "named by the test")]))
    dst = build_state(400_000, seed=1)
    loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, dst.parts, CPU, False)
    loader.chosen = given
    assert loader.find_resume().step == 2
    assert loader.chosen is None  # used once: a fall-back past step 2 chooses afresh
    reported = [(e["step"], e["reason"]) for e in read_jsonl(run.events)
                if e["event"] == "checkpoint_invalid"]
    assert reported == [(4, "named by the test")]
    assert loader.find_resume(below=4).step == 2 and loader.find_resume().step == 4


def read_chars() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


def test_a_same_job_vanilla_pick_is_read_into_the_page_cache_without_a_checksum_pass(
        tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "node1")
    run = saved_run(tmp_path, flip=False)  # committed by "job 4242": recorded (trust.py)
    size = (run.checkpoints / "step-4" / "state.pt").stat().st_size
    before = read_chars()
    choice = resume.choose_in_background(run.checkpoints, run.event).result(timeout=60)
    for thread in threading.enumerate():
        if thread.name == "pyrecover-choose":
            thread.join(60)
    assert choice.found is not None and choice.found.step == 4
    assert choice.found.checked == "same-job record"
    assert size <= read_chars() - before < 2 * size  # read once: the warm-up, no checksums


def test_a_resume_that_restores_nothing_puts_back_the_optimizer_and_the_weights_it_kept(
        tmp_path):
    run = saved_run(tmp_path, flip=False)
    saved = build_state(400_000, seed=0)
    with torch.no_grad():
        for p in saved.parts.model.parameters():
            p.add_(1.0)  # step 4's weights

    def refuse(_restored):
        raise ValueError("refused by the test")  # after the whole state was loaded

    for keep_weights in (True, False):
        other = build_state(400_000, seed=1)
        for s in other.parts.optimizer.state.values():
            s["exp_avg"].mul_(3.0)  # moments no checkpoint holds: a restore changes them
        weights = {k: v.clone() for k, v in other.parts.model.state_dict().items()}
        optimizer = other.parts.optimizer.state_dict()
        slots = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer["state"].items()}
        loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, other.parts, CPU, False)
        with pytest.raises(resume.ResumeFailed, match=r"the newest, step 4 .*refused by the"):
            loader.resume(accept=refuse, keep_weights=keep_weights)
        after = other.parts.optimizer.state_dict()
        assert after["param_groups"] == optimizer["param_groups"]
        for i, s in slots.items():
            assert all(torch.equal(after["state"][i][k], v) for k, v in s.items())
        now = other.parts.model.state_dict()
        if keep_weights:
            assert all(torch.equal(now[k], v) for k, v in weights.items())
        else:  # left as the last restore made them (step 2's): the caller initializes them
            assert not same_weights(other.parts.model, saved.parts.model)
            assert same_weights(other.parts.model, build_state(400_000, seed=0).parts.model)


def test_a_rank_waiting_for_a_long_choice_sees_rank_0s_beats_as_progress(tmp_path, monkeypatch):
    """A checkpoint of terabytes, or one on slow storage, keeps rank 0 checksumming for longer
    than the startup limit while the other ranks wait for its choice, reading nothing: they
    count rank 0's beats (train.py's watchdog progress) and do not fire until the beats stop.
    The slow pass is the stand-in here (a pick that keeps checksumming a file until the test
    lets it finish: beats follow reads, not the clock); the time the watchdog sees is a fake
    clock, ten seconds per beat."""
    from pyrecover.watchdog import Rule, Watchdog

    run = saved_run(tmp_path, flip=False)
    root = run.checkpoints
    release, real_pick = threading.Event(), resume.pick

    def slow_pick(*args):
        while not release.wait(0.005):
            store.sha256_file(root / "step-2" / store.MANIFEST)
        return real_pick(*args)

    monkeypatch.setattr(resume, "pick", slow_pick)
    monkeypatch.setattr(resume, "BEAT_S", 0.01)
    now = [1000.0]
    waiting = Watchdog(Rule(fixed=5, startup=60), rank=1, clock=lambda: now[0],
                       progress=lambda: resume.beats(root))
    waiting.phase("load")
    chosen = resume.choose_in_background(root, run.event)
    for _ in range(20):  # 200 s of the fake clock, more than three startup limits
        seen = resume.beats(root)
        assert wait_for(lambda: resume.beats(root) > seen)  # noqa: B023 (read at once)
        now[0] += 10
        assert waiting.check() is None
    release.set()
    assert chosen.result(timeout=60).found.step == 4
    assert not (root / resume.VERIFYING).exists() and resume.beats(root) == 0
    assert waiting.check() is None  # (the file's going is the last sign)
    now[0] += 61  # no beats any more: the wait is a hang again after the startup limit
    assert waiting.check().phase == "load"


def test_a_quick_choice_leaves_no_beats_behind(tmp_path):
    run = saved_run(tmp_path, flip=False)
    assert resume.choose_in_background(run.checkpoints, run.event).result(timeout=60).found
    assert sorted(p.name for p in run.checkpoints.iterdir()) == ["step-2", "step-4"]


def wait_for(condition, seconds: float = 60.0) -> bool:
    """wait_for polls `condition` until it holds (True) or `seconds` pass (False)."""
    import time

    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class BadSector:
    """Stands in for a disk that fails to read some files (EIO; a bad sector, or NFS's
    ESTALE), which this machine's storage cannot be made to do: store.checksum_ok raises for
    the files under `broken`, and reads the others as usual."""

    def __init__(self, monkeypatch, *broken: Path) -> None:
        real = store.checksum_ok

        def read(path: Path, meta: dict) -> bool:
            if any(b in path.parents for b in broken):
                raise OSError(5, "Input/output error", str(path))
            return real(path, meta)
        monkeypatch.setattr(store, "checksum_ok", read)


def test_a_checkpoint_that_cannot_be_read_is_skipped_and_none_readable_never_starts_over(
        tmp_path, monkeypatch):
    """An OSError while rank 0 checksummed the newest checkpoint went out of the pick as a
    traceback, at every start: the older checkpoint that verifies was never used."""
    run = saved_run(tmp_path, flip=False)
    BadSector(monkeypatch, run.checkpoints / "step-4")
    dst = build_state(400_000, seed=1)
    loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, dst.parts, CPU, False)
    loader.chosen = resume.choose_in_background(run.checkpoints, run.event)
    assert loader.find_resume().step == 2
    [invalid] = [e for e in read_jsonl(run.events) if e["event"] == "checkpoint_invalid"]
    assert invalid["step"] == 4 and "could not be read (OSError: Input/output error)" in \
        invalid["reason"]
    # Nothing readable at all: a storage fault, no proof the checkpoints are bad; the start
    # ends (exit 1, requeued) instead of training from step 0 beside them.
    BadSector(monkeypatch, run.checkpoints / "step-4", run.checkpoints / "step-2")
    with pytest.raises(resume.ResumeFailed, match="no checkpoint could be read; the newest, "
                                                  "step 4: .* does not start over"):
        loader.find_resume()
    assert {p.name for p in run.checkpoints.glob("step-*")} == {"step-2", "step-4"}


def test_a_skipped_checkpoint_below_the_next_commit_does_not_cost_the_one_resumed_from(
        tmp_path):
    """keep=2: commits at 400 and a stop save at 437; 437 is found corrupt, the run resumes
    from 400 and commits 500. Counted, 437 retired 400: one loadable checkpoint was left."""
    src = build_state(400_000, seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    saver = CheckpointManager(run, "vanilla", 100, 2, 0, 1, src.parts, CPU, False)
    saver.at_step(400)
    saver.finish(437)  # the stop's save
    state = run.checkpoints / "step-437" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    resumed = CheckpointManager(run, "vanilla", 100, 2, 0, 1, src.parts, CPU, False)
    assert resumed.find_resume().step == 400
    resumed.at_step(500)
    resumed.finish(500)
    assert {p.name for p in run.checkpoints.glob("step-*")} == {"step-400", "step-437",
                                                                "step-500"}
    assert store.verify(run.checkpoints / "step-400").step == 400


def test_a_checkpoint_corrupt_only_in_its_checksums_is_kept_for_inspection_when_redone(
        tmp_path):
    """Step 4 flipped in place (its size unchanged): the resume skipped it, went back to 2
    and saved 4 again. The commit's size check passed the old folder, which was deleted as
    an ordinary replaced save instead of kept as invalid-step-4-*."""
    run = saved_run(tmp_path, flip=True)
    flipped = (run.checkpoints / "step-4" / "state.pt").read_bytes()
    dst = build_state(400_000, seed=1)
    loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, dst.parts, CPU, False)
    assert loader.find_resume().step == 2
    loader.at_step(4)
    loader.finish(4)
    [kept] = run.checkpoints.glob("invalid-step-4-*")
    assert (kept / "state.pt").read_bytes() == flipped
    assert store.verify(run.checkpoints / "step-4").step == 4


def test_a_skipped_step_saved_again_counts_toward_keep_once_it_is_good(tmp_path):
    """keep=2 (3 before): 20 and 30 are found corrupt, the run resumes from 10 and saves 20,
    30 and 40. The new 20 and 30 stayed marked as skipped, so retention neither counted nor
    retired them: four checkpoints (10, 20, 30, 40) on disk for the rest of the run."""
    src = build_state(400_000, seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    saver = CheckpointManager(run, "vanilla", 10, 3, 0, 1, src.parts, CPU, False)
    for step in (10, 20):
        saver.at_step(step)
    saver.finish(30)
    for step in (20, 30):
        state = run.checkpoints / f"step-{step}" / "state.pt"
        state.write_bytes(state.read_bytes()[:100])
    resumed = CheckpointManager(run, "vanilla", 10, 2, 0, 1, src.parts, CPU, False)
    assert resumed.find_resume().step == 10
    for step in (20, 30):
        resumed.at_step(step)
    resumed.finish(40)
    assert {p.name for p in run.checkpoints.glob("step-*")} == {"step-30", "step-40"}
