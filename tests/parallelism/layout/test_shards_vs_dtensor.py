"""Shard maps checked against torch DTensor's own shard arithmetic, for every layout
DTensor can express: TP as Shard(tp_dim) on a "tp" mesh dim, ZeRO as a further Shard(0)
of the TP (or EP) box on the data-parallel mesh dim, EP as Shard(0) on an "ep" mesh dim."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
from torch.distributed.tensor import Replicate, Shard  # noqa: E402
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset  # noqa: E402

from parallelism.layout.placement import place  # noqa: E402
from parallelism.layout.shards import holder_boxes  # noqa: E402
from parallelism.layout.spec import ModuleLayout, parse_layout  # noqa: E402
from parallelism.layout.tensors import Model, ModuleSpec, TensorSpec, TensorSplit  # noqa: E402


def _dtensor_box(shape, ml: ModuleLayout, tensor: TensorSpec, sharded: bool, tp_rank: int, d: int):
    """(offsets, lengths) DTensor gives the rank at (tp_rank, d) of this module layout."""
    split = tensor.split
    mesh, coord, placements = [], [], []
    if split.ep_dim is not None:
        mesh.append(ml.ep); coord.append(d % ml.ep); placements.append(Shard(0))
    if split.tp_dim is not None:
        mesh.append(ml.tp); coord.append(tp_rank); placements.append(Shard(split.tp_dim))
    if sharded:
        edp = ml.dp * ml.cp // (ml.ep if split.ep_dim is not None else 1)
        mesh.append(edp); coord.append(d // ml.ep if split.ep_dim is not None else d); placements.append(Shard(0))
    if not mesh:
        return [0] * len(shape), list(shape)
    lengths, offsets = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
    return list(offsets), list(lengths)


@settings(max_examples=150, deadline=None)
@given(
    shape=st.lists(st.integers(1, 13), min_size=1, max_size=3).map(tuple),
    tp=st.sampled_from([1, 2, 3, 4, 8]),
    dp=st.integers(1, 5),
    cp=st.sampled_from([1, 2]),
    zero=st.integers(0, 3),
    data=st.data(),
)
def test_dense_boxes_match_dtensor(shape, tp, dp, cp, zero, data) -> None:
    tp_dim = data.draw(st.sampled_from([None, *range(len(shape))]))
    tensor = TensorSpec("llm.layers.0.x.weight", shape, TensorSplit("llm", 0, None, tp_dim, None, None))
    model = Model("m", "llama", (ModuleSpec("llm", 1, 24, 24),), (tensor,))
    layout = parse_layout(f"tp={tp},dp={dp},cp={cp},zero={zero}")
    ml = layout.modules[0]
    placement = place(model, layout)
    for state_class, sharded in (("param", zero >= 3), ("optim", zero >= 1)):
        boxes = holder_boxes(placement, tensor, state_class)
        ours = {int(r): (a0, a1, b0, b1) for r, a0, a1, b0, b1 in zip(boxes.rank, boxes.a0, boxes.a1, boxes.b0, boxes.b1)}
        for d in range(dp * cp):
            for tp_rank in range(tp):
                rank = tp_rank + tp * d
                offsets, lengths = _dtensor_box(shape, ml, tensor, sharded, tp_rank, d)
                if 0 in lengths:
                    assert rank not in ours, (rank, ours.get(rank))
                    continue
                a0, a1, b0, b1 = ours[rank]
                assert (offsets[0], lengths[0]) == (a0, a1 - a0)
                if tp_dim not in (None, 0):
                    assert (offsets[tp_dim], lengths[tp_dim]) == (b0, b1 - b0)


@settings(max_examples=60, deadline=None)
@given(experts=st.sampled_from([2, 4, 8]), inner=st.integers(1, 7), hidden=st.integers(1, 7),
       tp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 4]), zero=st.integers(0, 3), data=st.data())
def test_expert_boxes_match_dtensor(experts, inner, hidden, tp, dp, zero, data) -> None:
    ep = data.draw(st.sampled_from([e for e in (1, 2, 4) if dp % e == 0 and experts % e == 0]))
    tp_dim = data.draw(st.sampled_from([1, 2]))
    tensor = TensorSpec("llm.layers.0.moe.experts.up.weight", (experts, inner, hidden),
                        TensorSplit("llm", 0, None, tp_dim, None, 0))
    model = Model("m", "moe", (ModuleSpec("llm", 1, 8, 8, experts),), (tensor,))
    layout = parse_layout(f"tp={tp},dp={dp},ep={ep},zero={zero}")
    placement = place(model, layout)
    for state_class, sharded in (("param", zero >= 3), ("optim", zero >= 1)):
        boxes = holder_boxes(placement, tensor, state_class)
        ours = {int(r): (a0, a1, b0, b1) for r, a0, a1, b0, b1 in zip(boxes.rank, boxes.a0, boxes.a1, boxes.b0, boxes.b1)}
        for d in range(dp):
            for tp_rank in range(tp):
                offsets, lengths = _dtensor_box(tensor.shape, layout.modules[0], tensor, sharded, tp_rank, d)
                rank = tp_rank + tp * d
                if 0 in lengths:
                    assert rank not in ours
                    continue
                a0, a1, b0, b1 = ours[rank]
                assert (offsets[0], lengths[0], offsets[tp_dim], lengths[tp_dim]) == (a0, a1 - a0, b0, b1 - b0)


@settings(max_examples=120, deadline=None)
@given(units=st.sampled_from([1, 2, 3, 4]), share=st.sampled_from([2, 3, 4]), per_unit=st.integers(1, 4),
       other=st.integers(1, 5), dp=st.integers(1, 4), zero=st.integers(0, 3), data=st.data())
def test_replicated_unit_boxes_match_dtensor(units, share, per_unit, other, dp, zero, data) -> None:
    """Units (kv heads) fewer than tp = units * share: DTensor on the tp dim split in two,
    (head, copy), with Shard(tp_dim) on the first and Replicate on the second (what the
    checkpoint baseline saves them as) gives every rank exactly our box."""
    tp = units * share
    tp_dim = data.draw(st.sampled_from([0, 1]))
    shape = (units * per_unit, other) if tp_dim == 0 else (other, units * per_unit)
    tensor = TensorSpec("llm.layers.0.attn.k.weight", shape, TensorSplit("llm", 0, None, tp_dim, units, None))
    model = Model("m", "llama", (ModuleSpec("llm", 1, tp, units),), (tensor,))
    placement = place(model, f"tp={tp},dp={dp},zero={zero}")
    for state_class, sharded in (("param", zero >= 3), ("optim", zero >= 1)):
        boxes = holder_boxes(placement, tensor, state_class)
        ours = {int(r): (a0, a1, b0, b1) for r, a0, a1, b0, b1 in zip(boxes.rank, boxes.a0, boxes.a1, boxes.b0, boxes.b1)}
        mesh = [units, share] + ([dp] if sharded else [])
        placements = [Shard(tp_dim), Replicate()] + ([Shard(0)] if sharded else [])
        for d in range(dp):
            for tp_rank in range(tp):
                coord = [tp_rank // share, tp_rank % share] + ([d] if sharded else [])
                lengths, offsets = _compute_local_shape_and_global_offset(shape, mesh, coord, placements)
                rank = tp_rank + tp * d
                if 0 in lengths:
                    assert rank not in ours
                    continue
                a0, a1, b0, b1 = ours[rank]
                assert (offsets[0], lengths[0]) == (a0, a1 - a0)
                if tp_dim == 1:
                    assert (offsets[1], lengths[1]) == (b0, b1 - b0)
