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
