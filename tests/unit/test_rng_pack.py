"""RNG states packed into bytes (memory mode sends them with each slice) come back the same."""

from __future__ import annotations

import random

import pytest
import torch

from pyrecover.checkpoint import rng


def test_a_packed_rng_state_unpacks_to_the_captured_one_and_restores_the_same_stream():
    random.seed(3)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gauss_next in the python state
    state = rng.capture()
    room = torch.zeros(rng.RNG_BYTES, dtype=torch.uint8)
    rng.pack_into(state, room)
    back = rng.unpack(room)  # the zeros after the packed bytes are ignored
    assert back["python"] == state["python"] and back["python"][2] is not None
    assert torch.equal(back["torch"], state["torch"]) and back["cuda"] == state["cuda"]
    want = (random.random(), random.gauss(0, 1), torch.rand(4))
    rng.restore(back)
    got = (random.random(), random.gauss(0, 1), torch.rand(4))
    assert got[:2] == want[:2] and torch.equal(got[2], want[2])


def test_pack_into_a_buffer_too_small_says_how_much_room_it_needs():
    with pytest.raises(ValueError, match="takes .* bytes; room for 16"):
        rng.pack_into(rng.capture(), torch.zeros(16, dtype=torch.uint8))


def test_the_saved_cuda_stream_is_the_own_devices_on_any_gpu_layout(monkeypatch):
    """A checkpoint holds the CUDA generator of the rank's own device (one state); earlier
    ones held every device of the node, and restoring them all on a node with fewer GPUs
    (8 a node before, 4 now, or one visible GPU per task) raised on every requeue."""
    states = [torch.full((16,), d, dtype=torch.uint8) for d in range(8)]
    assert rng.own_cuda_state(states[:1], 3, 4) is states[0]  # this version's one state
    assert rng.own_cuda_state(states, 5, 8) is states[5]  # an earlier version's, same layout
    assert rng.own_cuda_state(states, 1, 4) is None  # ... another layout: none to restore
    # One GPU per task (SLURM's binding): every task's device is 0, and the state at index 0
    # is another task's stream, so none is restored.
    assert rng.own_cuda_state(states, 0, 1) is None
    # restore() on one device of 8 saved ones: only its own state is set (torch's
    # set_rng_state_all indexed a generator per saved state), the others as before.
    state = rng.capture() | {"cuda": states}
    want = torch.rand(2)
    torch.manual_seed(0)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    restored: list[torch.Tensor] = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", restored.append)
    rng.restore(state)
    assert restored == [states[0]] and torch.equal(torch.rand(2), want)


def test_a_process_that_never_used_cuda_saves_and_restores_no_cuda_state(monkeypatch):
    """A CPU run on a GPU node (train.device=cpu; gpu-check's CPU benches) must not start CUDA
    at every save and resume: only a process that started CUDA has a CUDA stream to keep.
    Here torch may report a GPU; whoever asks for its generator fails the test."""
    def no_cuda(*_):
        raise AssertionError("CUDA was touched by a process that never used it")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    for name in ("get_rng_state", "set_rng_state", "current_device", "device_count"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    state = rng.capture()
    assert state["cuda"] == []
    rng.restore(state | {"cuda": [torch.zeros(16, dtype=torch.uint8)]})  # an earlier GPU run's
