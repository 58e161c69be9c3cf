"""rng.check: a checkpoint's RNG record is tried on generators of its own before a resume
takes it, so a malformed one passes the checkpoint over instead of failing mid-resume."""

from __future__ import annotations

import random

import pytest
import torch

from pyrecover.checkpoint import rng


def good() -> dict:
    return rng.capture()


@pytest.mark.parametrize("change, said", [
    (lambda s: {"junk": torch.zeros(3)}, "is not a record of the python, torch and cuda"),
    (lambda s: [s], "is not a record"),
    (lambda s: {**s, "python": (3, (1, 2), None)}, "cannot be restored"),
    (lambda s: {**s, "python": "state"}, "cannot be restored"),
    (lambda s: {**s, "torch": torch.zeros(5, dtype=torch.uint8)}, "cannot be restored"),
    (lambda s: {**s, "torch": s["torch"].float()}, "cannot be restored"),
    (lambda s: {**s, "cuda": [torch.zeros(3)]}, "cuda part is not a list of byte tensors"),
    (lambda s: {**s, "cuda": "none"}, "cuda part is not a list of byte tensors"),
])
def test_a_malformed_record_is_refused_naming_the_part(change, said):
    with pytest.raises(ValueError, match=said):
        rng.check(change(good()))


def test_a_captured_record_passes_and_checking_leaves_this_process_s_generators_alone():
    saved = good()
    random.seed(1)
    torch.manual_seed(1)
    expected = (random.random(), torch.rand(3))
    random.seed(1)
    torch.manual_seed(1)
    rng.check(saved)  # another state than the seeded one: checked elsewhere, not applied
    assert (random.random(), torch.rand(3))[0] == expected[0]
    random.seed(1)
    torch.manual_seed(1)
    rng.check(saved)
    random.random()
    assert torch.equal(torch.rand(3), expected[1])
