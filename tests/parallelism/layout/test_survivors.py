"""survivors.uncovered: checked against an element-by-element count on random models and
layouts (hypothesis), and on the cases a node loss meets."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.layout.shards import OPTIM, PARAM, b_dim, holder_boxes
from parallelism.layout.survivors import uncovered
from tests.parallelism.layout.strategies import layouts, models


def _brute(placement, survivors) -> list[tuple[str, str]]:
    out = []
    for tensor in placement.model.tensors:
        bd = b_dim(tensor)
        for cls in (PARAM, OPTIM):
            boxes = holder_boxes(placement, tensor, cls)
            held = np.zeros((tensor.shape[0], tensor.shape[bd] if bd is not None else 1), dtype=bool)
            for r, a0, a1, b0, b1 in zip(boxes.rank, boxes.a0, boxes.a1, boxes.b0, boxes.b1):
                if r in survivors:
                    held[a0:a1, b0:b1] = True
            if not held.all():
                out.append((tensor.name, cls))
    return out


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_uncovered_matches_an_element_count(data) -> None:
    model = data.draw(models())
    placement = place(model, data.draw(layouts(model, max_world=16)))
    survivors = set(data.draw(st.lists(st.integers(0, placement.world - 1), unique=True)))
    assert uncovered(placement, survivors) == _brute(placement, survivors)
    assert uncovered(placement, range(placement.world)) == []
    assert (uncovered(placement, []) == []) == (not any(t.shape[0] for t in model.tensors))


def test_node_loss_cases() -> None:
    spec = get_model("tiny-gpt")
    # dp=2 over two nodes: either rank alone is a full replica.
    assert uncovered(place(spec, "dp=2"), {1}) == []
    # ZeRO-1: the optimizer states are split over the data-parallel ranks.
    lost = uncovered(place(spec, "dp=2,zero=1"), {0})
    assert lost and {cls for _, cls in lost} == {"optim"}
    # tp=2,dp=2 with ranks 2, 3 (one TP group) lost: ranks 0, 1 still form a replica; 0 and 2 do not.
    assert uncovered(place(spec, "tp=2,dp=2"), {0, 1}) == []
    assert uncovered(place(spec, "tp=2,dp=2"), {0, 2})
