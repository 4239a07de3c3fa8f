"""Shard maps of tensors split by units (heads) over tp, units fewer than tp included (a kv
head replicated on tp/units TP ranks, issue 29), over random models and layouts: every
element of every state is owned, each exactly as often as the layout replicates it, and
the ranks that replicate a unit hold identical boxes."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from parallelism.layout.placement import place
from parallelism.layout.shards import b_dim, holder_boxes, is_sharded
from tests.parallelism.layout.strategies import layouts, models


@st.composite
def placements(draw):
    model = draw(models(draw(st.sampled_from(["dense", "multimodal"]))))
    return place(model, draw(layouts(model)))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(placements())
def test_every_element_is_owned_and_replicas_hold_the_same_box(placement) -> None:
    seen_replicated = False
    for tensor in placement.model.tensors:
        ml = placement.modules[tensor.split.module]
        units, data = tensor.split.tp_units, ml.dp * ml.cp
        replicated = units is not None and units < ml.tp
        seen_replicated |= replicated
        for state_class in ("param", "optim"):
            sharded = is_sharded(state_class, ml.zero)
            boxes = holder_boxes(placement, tensor, state_class)
            # Copies of each element per stage: tp/units when its unit is replicated, tp when
            # TP does not split the tensor, else 1; times the data ranks unless ZeRO cuts it.
            tp_copies = ml.tp // units if replicated else (ml.tp if tensor.split.tp_dim is None else 1)
            expected = tp_copies * (1 if sharded else data)
            b_len = tensor.shape[b_dim(tensor)] if b_dim(tensor) is not None else 1
            for stage in placement.tensor_stages(tensor):
                first = ml.offset + stage * ml.tp * data
                mine = (boxes.rank >= first) & (boxes.rank < first + ml.tp * data)
                count = np.zeros((tensor.shape[0], b_len), dtype=np.int64)
                for a0, a1, b0, b1 in zip(boxes.a0[mine], boxes.a1[mine], boxes.b0[mine], boxes.b1[mine]):
                    count[a0:a1, b0:b1] += 1
                assert (count == expected).all(), (tensor.name, state_class, stage, np.unique(count), expected)
            if replicated:  # the TP ranks of one unit (same stage and data rank) hold one box
                local = boxes.rank - ml.offset
                key = np.stack([local // (ml.tp * data), (local % (ml.tp * data)) // ml.tp,
                                (local % ml.tp) // (ml.tp // units)], axis=1)
                box = np.stack([boxes.a0, boxes.a1, boxes.b0, boxes.b1], axis=1)
                for k in np.unique(key, axis=0):
                    same = (key == k).all(axis=1)
                    assert same.sum() == ml.tp // units and (box[same] == box[same][0]).all(), (tensor.name, k)
    if any(ml.tp > m.num_kv_heads for m in placement.model.modules for ml in [placement.modules[m.name]]):
        assert seen_replicated
