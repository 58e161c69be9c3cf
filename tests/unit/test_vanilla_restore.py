"""A vanilla restore leaves nothing of the state file mapped: the optimizer state that stays
on the CPU is the process's own memory, exact, so the first update does not copy the file's
pages one fault at a time and the file can go (rotation, a user's cleanup) under a live run."""

from __future__ import annotations

from pathlib import Path

import torch
from helpers import saved_and_restored

from pyrecover.bench.state import build_state


def mapped(path: Path) -> list[tuple[int, int]]:
    """mapped is the address ranges where this process maps `path` (Linux's /proc maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        if line.endswith(str(path)):
            start, end = line.split()[0].split("-")
            ranges.append((int(start, 16), int(end, 16)))
    return ranges


def test_a_vanilla_restore_owns_its_optimizer_state(tmp_path):
    src, dst = build_state(2_000_000, seed=0), build_state(2_000_000, seed=1)
    ckpt = saved_and_restored(tmp_path, "vanilla", src, dst)
    state_file = (ckpt.path / "state.pt").resolve()

    saved = [v for s in src.parts.optimizer.state.values() for v in s.values()]
    restored = [v for s in dst.parts.optimizer.state.values() for v in s.values()]
    assert len(restored) == len(saved) > 0
    for want, got in zip(saved, restored, strict=True):
        assert torch.equal(got, want)
    held = restored + list(dst.parts.model.parameters())
    in_file = [t for t in held for lo, hi in mapped(state_file) if lo <= t.data_ptr() < hi]
    assert not in_file, f"{len(in_file)} of {len(held)} tensors still live in the mapped file"
