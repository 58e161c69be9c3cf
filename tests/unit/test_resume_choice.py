"""Rank 0's choice of the checkpoint to resume, begun in the background while the model is
built (resume.choose_in_background): it picks what the plain pass picks, reports what it
skipped once, and a resume that uses it restores the same state."""

from __future__ import annotations

import torch

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, resume
from pyrecover.rundir import RunDir, read_jsonl

CPU = torch.device("cpu")


def saved_run(tmp_path, mode: str = "vanilla"):
    """A run directory with checkpoints at steps 2 and 4 of one small state; step 4's file
    has one byte flipped after its commit."""
    src = build_state(400_000, seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    saver = CheckpointManager(run, mode, 2, 3, 0, 1, src.parts, CPU, False)
    saver.at_step(2)
    with torch.no_grad():
        for p in src.parts.model.parameters():
            p.add_(1.0)  # step 4 holds other weights than step 2
    saver.at_step(4)
    saver.finish(4)
    state = run.checkpoints / "step-4" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    return run


def test_the_pick_begun_in_the_background_is_the_plain_pick(tmp_path):
    run = saved_run(tmp_path)
    plain = resume.choose(run.checkpoints, None, run.event)
    early = resume.choose_in_background(run.checkpoints, run.event).result(timeout=60)
    for choice in (plain, early):
        assert choice.found is not None and choice.found.step == 2
        assert choice.found.checked == "checksums"
        assert [(step, "corrupt" in problem) for step, _, problem in choice.invalid] == [(4, True)]


def test_a_resume_given_the_early_pick_restores_it_and_reports_the_skipped_one_once(tmp_path):
    run = saved_run(tmp_path)
    want = build_state(400_000, seed=0)  # the weights of step 2
    dst = build_state(400_000, seed=1)
    loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, dst.parts, CPU, False)
    loader.chosen = resume.choose_in_background(run.checkpoints, run.event)
    found = loader.resume(keep_weights=False)
    assert found is not None and found[0].step == 2
    for got, saved in zip(dst.parts.model.parameters(), want.parts.model.parameters(),
                          strict=True):
        assert torch.equal(got, saved)
    invalid = [e for e in read_jsonl(run.events) if e["event"] == "checkpoint_invalid"]
    assert [e["step"] for e in invalid] == [4]
    assert loader.chosen is None  # used once: a fall-back past step 2 chooses afresh


def test_a_resume_that_restores_nothing_puts_the_optimizer_back_weights_left_to_the_caller(
        tmp_path):
    src = build_state(400_000, seed=0)
    run = RunDir(tmp_path / "run")
    run.create()
    CheckpointManager(run, "vanilla", 2, 3, 0, 1, src.parts, CPU, False).finish(2)
    other = build_state(1_600_000, seed=1)  # another shape: its restore fails part way
    before = {k: v.clone() for k, v in other.parts.model.state_dict().items()}
    optimizer = other.parts.optimizer.state_dict()
    loader = CheckpointManager(run, "vanilla", 2, 3, 0, 1, other.parts, CPU, False)
    assert loader.resume(keep_weights=True) is None
    assert all(torch.equal(v, before[k]) for k, v in other.parts.model.state_dict().items())
    assert loader.resume(keep_weights=False) is None
    after = other.parts.optimizer.state_dict()
    assert after["param_groups"] == optimizer["param_groups"]
    for i, slots in optimizer["state"].items():
        assert all(torch.equal(after["state"][i][k], v) for k, v in slots.items())
