"""Zero-size boxes (docs/contracts.md sections 2-3): torch.chunk leaves the last parts of a short
dimension empty; shard maps leave them out, and `keep_empty` gives the trainers every
holder's box, empty ones included (they build an empty tensor there)."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import place
from parallelism.layout.shards import OPTIM, PARAM, holder_boxes
from tests.parallelism.layout.strategies import layouts, models


def _drawn(data):
    model = data.draw(models())
    text = data.draw(layouts(model, 16))
    try:
        return model, place(model, text)
    except LayoutError:
        assume(False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_shard_maps_are_the_non_empty_rows_of_every_holders_boxes(data) -> None:
    model, placement = _drawn(data)
    for tensor in model.tensors:
        ml = placement.modules[tensor.split.module]
        stages = placement.tensor_stages(tensor)
        holders = sorted(ml.offset + s * ml.tp * ml.dp * ml.cp + i for s in stages
                         for i in range(ml.tp * ml.dp * ml.cp))
        for state_class in (PARAM, OPTIM):
            every = holder_boxes(placement, tensor, state_class, keep_empty=True)
            held = holder_boxes(placement, tensor, state_class)
            assert every.rank.tolist() == holders  # each holder rank once, in rank order
            size = (every.a1 - every.a0) * (every.b1 - every.b0)
            assert (size >= 0).all() and (every.a0 <= tensor.shape[0]).all()
            keep = size > 0
            for name in ("rank", "a0", "a1", "b0", "b1"):
                assert np.array_equal(getattr(held, name), getattr(every, name)[keep]), (tensor.name, name)
            assert (held.size > 0).all()


def test_a_one_row_tensor_has_empty_zero_chunks_past_the_first_rank() -> None:
    from parallelism.layout.catalog import get_model

    placement = place(get_model("tiny-vlm"), "encoder:dp=4,zero=1;llm:dp=4")
    cls = next(t for t in placement.model.tensors if t.name == "encoder.cls_token")
    every = holder_boxes(placement, cls, OPTIM, keep_empty=True)
    assert [(int(a), int(b)) for a, b in zip(every.a0, every.a1)] == [(0, 1), (1, 1), (1, 1), (1, 1)]
    assert holder_boxes(placement, cls, OPTIM).rank.tolist() == [0]
    assert holder_boxes(placement, cls, PARAM).rank.tolist() == [0, 1, 2, 3]  # the bf16 param is replicated


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_ranks_boxes_are_its_row_of_every_holders_boxes(data) -> None:
    """`only_rank` (what a rank's own shards are built from) agrees with the full table for
    every rank of the world and for ranks outside it, with and without empty boxes."""
    model, placement = _drawn(data)
    world = placement.world
    for tensor in model.tensors:
        for state_class in (PARAM, OPTIM):
            for keep_empty in (False, True):
                every = holder_boxes(placement, tensor, state_class, keep_empty=keep_empty)
                for rank in (-1, *range(world), world):
                    mine = holder_boxes(placement, tensor, state_class, keep_empty=keep_empty, only_rank=rank)
                    rows = every.rank == rank
                    for name in ("rank", "a0", "a1", "b0", "b1"):
                        assert np.array_equal(getattr(mine, name), getattr(every, name)[rows]), (tensor.name, rank)
