"""Memory mode's disk format read back: every tensor exact, whatever the piece size and the
alignment of the tensors in the flat state, and the model's bytes not kept afterwards."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from helpers import saved_and_restored

from pyrecover.bench.state import build_state
from pyrecover.checkpoint import CheckpointManager, store
from pyrecover.checkpoint.memory import persist as memory
from pyrecover.rundir import RunDir


def with_odd_buffer(state):
    """A 3-byte uint8 buffer first in the model puts every later tensor at an odd offset."""
    state.parts.model.register_buffer("flags", torch.tensor([1, 2, 3], dtype=torch.uint8))
    return state


def live(parts) -> dict[str, torch.Tensor]:
    out = {f"model/{k}": v for k, v in parts.model.state_dict().items()}
    for i, per_param in enumerate(parts.optimizer.state.values()):
        out |= {f"optim/{i}/{k}": v for k, v in per_param.items()}
    return out


@pytest.mark.parametrize("piece", [4096, 1 << 20, memory.READ_PIECE])
@pytest.mark.parametrize("odd", [False, True], ids=["aligned", "odd-offsets"])
def test_a_memory_checkpoint_restores_every_tensor_exactly(tmp_path, monkeypatch, piece, odd):
    monkeypatch.setattr(memory, "READ_PIECE", piece)
    src, dst = build_state(3_000_000, seed=0), build_state(3_000_000, seed=1)
    if odd:
        src, dst = with_odd_buffer(src), with_odd_buffer(dst)
        dst.parts.model.flags.zero_()
    saved_and_restored(tmp_path, "memory", src, dst)
    want, got = live(src.parts), live(dst.parts)
    assert want.keys() == got.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    model_bytes = sum(t.numel() * t.element_size() for t in dst.parts.model.state_dict().values())
    optim = [v for s in dst.parts.optimizer.state.values() for v in s.values()]
    # The optimizer state holds no reference to the model's bytes: only its own segment.
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in optim}
    assert sum(held.values()) <= sum(t.numel() * t.element_size() for t in optim) + 64
    assert model_bytes > 0


def test_the_tied_head_is_snapshotted_once_and_restored_and_exported_still_tied(tmp_path):
    """The head is the token embedding's tensor: a snapshot used to copy (and a checkpoint
    to store) it twice, and an export to untie it."""
    from pyrecover import offline
    from pyrecover.checkpoint import tools

    src, dst = build_state(2_000_000, seed=0), build_state(2_000_000, seed=1)
    assert src.parts.model.head.weight is src.parts.model.wte.weight
    ckpt = saved_and_restored(tmp_path, "memory", src, dst)
    unique = {t.data_ptr(): t.numel() * t.element_size()
              for t in src.parts.model.state_dict().values()}
    optim = [v for s in src.parts.optimizer.state.values() for v in s.values()]
    state_bytes = sum(unique.values()) + sum(t.numel() * t.element_size() for t in optim)
    parts = sum(f.stat().st_size for f in ckpt.path.glob("part-*.bin"))
    assert parts == state_bytes  # the embedding once
    model = dst.parts.model
    assert model.head.weight is model.wte.weight
    for key, value in src.parts.model.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    exported = tools.model_state(ckpt, offline.build_model)
    assert exported["head.weight"] is exported["wte.weight"]  # tied, as vanilla's is
    assert torch.equal(exported["wte.weight"], src.parts.model.wte.weight)


def test_a_truncated_part_file_is_named_in_one_error(tmp_path):
    state = build_state(1_000_000)
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "memory", 2, 2, 0, 1, state.parts, torch.device("cpu"),
                                False)
    manager.at_step(2)
    manager.finish(2)
    folder = run.checkpoints / "step-2"
    part = next(folder.glob("part-s0-r0.bin"))
    with part.open("r+b") as f:
        f.truncate(part.stat().st_size - 10)
    names = list(store.read_manifest(folder)["files"])
    with pytest.raises(store.CheckpointError, match="part-s0-r0.bin: .* bytes, the slice has"):
        memory.assemble(folder, names)


def rewrite_manifest(folder, change) -> None:
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest["files"])
    path.write_text(json.dumps(manifest))


def test_ckpt_verify_refuses_a_memory_checkpoint_that_lacks_a_slice_or_has_a_bad_rng_record(
        tmp_path):
    """Its manifest fixed up as a broken tool would (a part file dropped; a meta whose RNG
    record no generator takes): `ckpt ls` and `verify` said ok, export and a resume then
    found it unreadable. They read the same as a dcp or vanilla checkpoint's check does."""
    from pyrecover.checkpoint import listing

    state = build_state(1_000_000)
    run = RunDir(tmp_path / "run")
    run.create()
    manager = CheckpointManager(run, "memory", 2, 3, 0, 1, state.parts, torch.device("cpu"),
                                False)
    for step in (2, 4, 6):
        manager.at_step(step)
    manager.finish(6)
    no_part, bad_rng = run.checkpoints / "step-6", run.checkpoints / "step-4"
    (no_part / "part-s0-r0.bin").unlink()
    rewrite_manifest(no_part, lambda files: files.pop("part-s0-r0.bin"))
    meta = torch.load(bad_rng / "meta-r0.pt", weights_only=True)
    meta["rngs"] = [{"python": 1, "torch": torch.zeros(3), "cuda": []}]
    torch.save(meta, bad_rng / "meta-r0.pt")
    data = (bad_rng / "meta-r0.pt").read_bytes()
    rewrite_manifest(bad_rng, lambda files: files.__setitem__("meta-r0.pt", {
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}))
    rows = {r.step: r.problem for r in listing.list_checkpoints(run)}
    assert "slices [0] are in no part file" in rows[6], rows
    assert "its RNG state (rank 0) cannot be restored" in rows[4], rows
    assert rows[2] == "", rows


def survivors_of_step_14(tmp_path) -> RunDir:
    """survivors_of_step_14 is a memory run that committed step 10, then snapshotted steps 12
    and 14 and crashed, its survivors persisting step 14's snapshot (`.snap-step-14`)."""
    state, run, first = memory_run(tmp_path, interval=10, keep=3)
    first.at_step(10)
    first.finish(10)
    second = memory_run(tmp_path, interval=10, keep=3, state=state)[2]
    for step in (12, 14):
        second.at_step(step)
    second.persist_after_failure()
    return run


def memory_run(tmp_path, interval: int, keep: int, state=None):
    """(state, run, manager): memory mode at world size 1, a snapshot every 2 steps, in the
    run directory `tmp_path/run` (a second call with the same `state` is its restart)."""
    state = state or build_state(1_000_000)
    run = RunDir(tmp_path / "run")
    run.create()
    return state, run, CheckpointManager(run, "memory", interval, keep, 0, 1, state.parts,
                                         torch.device("cpu"), False, snapshot_interval=2)


def test_the_survivors_snapshot_is_kept_below_a_newer_checkpoint_that_does_not_verify(tmp_path):
    """step-20 is corrupt, so the run resumed from an older one; then a rank died at step 14
    and the survivors persisted their snapshot. It was dropped for being below step-20, and
    the resume went back past it to the disk checkpoint before: a whole interval redone."""
    from pyrecover.checkpoint import resume

    state, run, first = memory_run(tmp_path, interval=10, keep=3)
    for step in (10, 20):
        first.at_step(step)
    first.finish(20)
    part = next((run.checkpoints / "step-20").glob("part-s0-r0.bin"))
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    second = memory_run(tmp_path, interval=10, keep=3, state=state)[2]
    for step in (12, 14):  # resumed from 10; snapshots at 12 and 14, then a peer died
        second.at_step(step)
    second.persist_after_failure()
    assert (run.checkpoints / ".snap-step-14").is_dir()
    events = []
    resume.tidy(run.checkpoints, lambda kind, **fields: events.append((kind, fields["step"])))
    assert ("snapshot_recovered", 14) in events
    assert resume.pick(run.checkpoints, None, {}).found.step == 14  # step 20 does not verify


def test_a_hang_s_persist_is_not_overwritten_by_a_snapshot_of_a_main_thread_that_went_on(
        tmp_path):
    """The hang handler persists in the watchdog's thread; where the stalled collective then
    finished, the main thread's next snapshot recycled the very buffers being written, and
    the part file mixed two steps under a checksum that still passed. The disk is a
    stand-in that holds the persist's writes until the test lets them through."""
    import threading

    state, run, manager = memory_run(tmp_path, interval=100, keep=2)
    for step in (2, 4):
        manager.at_step(step)
        with torch.no_grad():
            for p in state.parts.model.parameters():
                p.add_(1.0)  # each step's weights differ
    snaps = manager.mode
    expected = {s.step: s.slices[0].clone() for s in (snaps.current, snaps.previous)}
    assert set(expected) == {2, 4}
    writing, go, real_write = threading.Event(), threading.Event(), snaps.write

    def slow_disk(folder, snap, slice_ids):
        writing.set()
        assert go.wait(60), "the test never let the write through"
        return real_write(folder, snap, slice_ids)

    snaps.write = slow_disk
    persist = threading.Thread(target=snaps.persist_survivor, args=(run.checkpoints,))
    persist.start()
    assert writing.wait(60)
    def go_on() -> None:  # the main thread goes on: steps 8 and 10 recycle 2's and 4's sets
        for step in (6, 8, 10):
            manager.at_step(step)

    later = threading.Thread(target=go_on)
    later.start()
    later.join(timeout=0.5)  # (it may not even have started: that proves nothing either way)
    go.set()
    persist.join(60)
    later.join(60)
    for step, want in expected.items():
        part = run.checkpoints / f".snap-step-{step}" / "part-s0-r0.bin"
        got = torch.frombuffer(bytearray(part.read_bytes()), dtype=torch.uint8)
        assert torch.equal(got[:want.numel()], want), step


def test_storage_failing_on_a_survivors_snapshot_keeps_the_snapshot_for_the_next_start(
        tmp_path, monkeypatch):
    """EIO while the start reads the survivors' snapshot: an error (exit 1, requeued), not
    'slices missing', which deleted the newest state the run had."""
    import os

    from pyrecover.checkpoint import resume

    run = survivors_of_step_14(tmp_path)
    snap = run.checkpoints / ".snap-step-14"
    real = os.lstat

    def failing(path, *args, **kwargs):
        if snap in Path(path).parents:
            raise OSError(5, "Input/output error", str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "lstat", failing)
    with pytest.raises(OSError, match="Input/output error"):
        resume.tidy(run.checkpoints, lambda *a, **k: None)
    monkeypatch.setattr(os, "lstat", real)
    assert snap.is_dir()
    events = []
    resume.tidy(run.checkpoints, lambda kind, **fields: events.append((kind, fields["step"])))
    assert ("snapshot_recovered", 14) in events  # the next start, on storage that answers


def test_a_snapshot_whose_persist_did_not_finish_is_named_as_such_not_as_dead_holders(tmp_path):
    """A full disk tore the survivors' part files before any done marker: the start said
    "slices [-1] were held only by ranks that died", of a run in which no rank had died."""
    root = tmp_path / "checkpoints"
    torn = root / f"{memory.SNAP_PREFIX}30"
    torn.mkdir(parents=True)
    (torn / "part-s0-r0.bin").write_bytes(bytes(32768))
    (torn / "part-s0-r1.bin").write_bytes(b"")
    said = []
    memory.finalize_snapshots(root, lambda kind, **fields: said.append((kind, fields)))
    assert [(kind, fields["step"]) for kind, fields in said] == [("checkpoint_invalid", 30)]
    reason = said[0][1]["reason"]
    assert reason == ("the surviving ranks' snapshot of step 30 is incomplete: no rank's "
                      "persisted files of it verify (a write that did not finish, as on a "
                      "full disk)"), reason
    assert not torn.exists()


@pytest.mark.parametrize("junk", ["{}", "[1]", '{"files": [1]}', '{"files": {"x": 1}}',
                                  '{"files": {"part-s0-r0.bin": {"size": "1"}}}'])
def test_a_survivors_done_marker_filled_with_junk_is_skipped_not_a_traceback(tmp_path, junk):
    """A done marker that is JSON but not a marker's shape stopped every start with a
    KeyError or TypeError from tidy: the run could not resume until someone deleted it."""
    from pyrecover.checkpoint import resume

    run = survivors_of_step_14(tmp_path)
    (run.checkpoints / ".snap-step-14" / "done-r0.json").write_text(junk)
    events = []
    resume.tidy(run.checkpoints, lambda kind, **fields: events.append((kind, fields["step"])))
    assert events == [("checkpoint_invalid", 14), ("snapshot_recovered", 12)], events
    assert resume.pick(run.checkpoints, None, {}).found.step == 12


def test_a_survivors_part_file_that_is_corrupt_is_named_as_such_not_as_dead_holders(tmp_path):
    """A truncated part file of the survivors' snapshot was reported as "slices [0] were held
    only by ranks that died", in a run whose one rank lived, and the start said it fell back
    to the newest disk checkpoint while it committed an older snapshot."""
    from pyrecover.checkpoint import resume

    run = survivors_of_step_14(tmp_path)
    part = run.checkpoints / ".snap-step-14" / "part-s0-r0.bin"
    part.write_bytes(part.read_bytes()[:100])
    said = []
    resume.tidy(run.checkpoints, lambda kind, **fields: said.append((kind, fields)))
    assert [(kind, fields["step"]) for kind, fields in said] == [
        ("checkpoint_invalid", 14), ("snapshot_recovered", 12)], said
    assert said[0][1]["reason"] == (
        "the surviving ranks' snapshot of step 14 is incomplete: the persisted part files "
        "of slices [0] do not verify (truncated or corrupt)"), said
