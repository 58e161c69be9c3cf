"""Memory mode's placement: who holds which slice, for any world size, node size and replicas."""

from __future__ import annotations

import pytest

from pyrecover.checkpoint.memory import holders, slice_bounds

SHAPES = [(world, rpn) for world in range(1, 17) for rpn in (1, 2, 3, 4, 8) if rpn <= world]


@pytest.mark.parametrize(("world", "rpn"), SHAPES)
@pytest.mark.parametrize("replicas", [1, 2, 3, 4])
def test_every_slice_has_distinct_holders_and_every_round_is_one_slice_per_rank(world, rpn,
                                                                               replicas):
    table = [holders(s, world, replicas, rpn) for s in range(world)]
    node = [r // rpn for r in range(world)]
    nodes = world // rpn
    for s, held in enumerate(table):
        assert held[0] == s  # the owner keeps its own slice
        assert len(held) == min(replicas, world) == len(set(held)), (s, held)
        if nodes > 1 and world == nodes * rpn:  # replicas leave the node while nodes remain
            first = [node[r] for r in held[:nodes]]
            assert len(set(first)) == len(first), (s, held)
    for k in range(min(replicas, world)):  # each round: every rank receives exactly one slice
        assert sorted(held[k] for held in table) == list(range(world)), k


def test_two_nodes_of_four_with_three_replicas_use_both_nodes_then_a_neighbour():
    assert holders(1, 8, 3, 4) == [1, 5, 2]


@pytest.mark.parametrize("total", [0, 1, 7, 1000, 2**31 + 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_slices_cover_the_state_in_order_and_differ_by_at_most_a_byte(total, n):
    bounds = slice_bounds(total, n)
    assert bounds[0][0] == 0 and bounds[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1
