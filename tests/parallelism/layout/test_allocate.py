"""Placing a layout's ranks on free GPUs (properties over random clusters)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.layout.allocate import AllocationError, FreeGpus, allocate


@st.composite
def clusters(draw):
    nodes = draw(st.integers(1, 6))
    free = []
    for n in range(nodes):
        size = draw(st.sampled_from([2, 4, 8]))
        taken = draw(st.sets(st.integers(0, size - 1), max_size=size))
        free.append(FreeGpus(f"node-{n}", tuple(g for g in range(size) if g not in taken)))
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    world = tp * draw(st.integers(1, 12))
    return free, tp, world


@settings(max_examples=300, deadline=None)
@given(clusters())
def test_every_rank_gets_one_free_gpu_and_tp_groups_stay_on_one_node(case) -> None:
    free, tp, world = case
    capacity = sum(len(f.gpus) // tp for f in free)
    if capacity < world // tp:
        with pytest.raises(AllocationError, match=f"need {world // tp} groups of tp={tp}"):
            allocate(world, tp, free)
        return
    slots = allocate(world, tp, free)
    assert [s.rank for s in slots] == list(range(world))
    assert len({(s.node, s.gpu) for s in slots}) == world  # no GPU twice
    free_set = {(f.node, g) for f in free for g in f.gpus}
    assert all((s.node, s.gpu) in free_set for s in slots)
    for group in range(world // tp):
        assert len({s.node for s in slots[group * tp:(group + 1) * tp]}) == 1
    assert allocate(world, tp, list(reversed(free))) == slots  # the listing order does not matter


def test_full_nodes_take_consecutive_ranks_so_pipeline_stages_cross_nodes() -> None:
    """tp=4, dp=2, pp=2 on two free 8-GPU nodes: stage 0 (ranks 0-7) on one node, stage 1 on the other."""
    free = [FreeGpus("b", tuple(range(8))), FreeGpus("a", tuple(range(8)))]
    slots = allocate(16, 4, free)
    assert {s.node for s in slots[:8]} == {"a"} and {s.node for s in slots[8:]} == {"b"}
    assert [s.gpu for s in slots[:8]] == list(range(8))


def test_fragmented_free_gpus_that_cannot_hold_a_tp_group_are_refused_with_numbers() -> None:
    free = [FreeGpus("a", (0, 1, 2)), FreeGpus("b", (5, 6, 7))]  # 6 free GPUs, no 4 on one node
    with pytest.raises(AllocationError, match=r"need 1 groups of tp=4 GPUs on one node each; the free GPUs hold 0 "
                                              r"\(largest free block 3 GPUs on one node, 6 free in all\)"):
        allocate(4, 4, free)
    with pytest.raises(AllocationError, match="positive multiple of tp=4"):
        allocate(6, 4, free)
