"""The boundary plan of an activation between two module layouts, checked against a numpy
oracle: every receiver (rank, element) is covered exactly once, by a piece its sender
holds, and forward then backward gives every sender its box back exactly."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.planner.activations import ActivationShape, Exchange, activation_holders, plan_boundary
from parallelism.layout.errors import LayoutError
from parallelism.layout.spec import ModuleLayout


@st.composite
def module_layouts(draw, name: str):
    return ModuleLayout(name, tp=draw(st.integers(1, 3)), pp=draw(st.integers(1, 3)), dp=draw(st.integers(1, 5)),
                        cp=draw(st.integers(1, 3)))


@st.composite
def boundaries(draw):
    enc, llm = draw(module_layouts("encoder")), draw(module_layouts("llm"))
    if draw(st.booleans()):  # non-colocated: the LLM's ranks follow the encoder's
        enc = _at(enc, 0)
        llm = _at(llm, enc.world + draw(st.integers(0, 2)))
    # Uneven on purpose: batches and token counts that dp and cp do not divide, some below dp.
    shape = ActivationShape(draw(st.integers(1, 13)), draw(st.integers(1, 7)), draw(st.integers(1, 3)))
    return enc, llm, shape


def _at(ml: ModuleLayout, first: int) -> ModuleLayout:
    return ModuleLayout(ml.module, ml.tp, ml.pp, ml.vpp, ml.dp, ml.cp, ml.ep, ml.zero, first)


def _apply(exchange: Exchange, held: dict[int, np.ndarray], full_shape: tuple[int, int, int]) -> dict[int, np.ndarray]:
    """Run an exchange on numpy arrays (held: sender rank -> its box's values); every
    receiver element must be written exactly once and only from what the sender holds."""
    out: dict[int, np.ndarray] = {}
    writes: dict[int, np.ndarray] = {}
    recv, send = exchange.recv_holders, exchange.send_holders
    for i, rank in enumerate(recv.rank):
        shape = (int(recv.a1[i] - recv.a0[i]), int(recv.b1[i] - recv.b0[i]), full_shape[2])
        out[int(rank)] = np.full(shape, np.nan)
        writes[int(rank)] = np.zeros(shape[:2], dtype=int)

    def copy(sender: int, receiver: int, a0: int, a1: int, b0: int, b1: int) -> None:
        sb = exchange.box_of(send, sender)
        rb = exchange.box_of(recv, receiver)
        assert sb is not None and rb is not None
        assert sb[0] <= a0 < a1 <= sb[1] and sb[2] <= b0 < b1 <= sb[3], "a piece the sender does not hold"
        piece = held[sender][a0 - sb[0]:a1 - sb[0], b0 - sb[2]:b1 - sb[2]]
        out[receiver][a0 - rb[0]:a1 - rb[0], b0 - rb[2]:b1 - rb[2]] = piece
        writes[receiver][a0 - rb[0]:a1 - rb[0], b0 - rb[2]:b1 - rb[2]] += 1

    b = exchange.boxes
    for s, d, a0, a1, b0, b1 in zip(exchange.src, b.rank, b.a0, b.a1, b.b0, b.b1):
        assert s != d
        copy(int(s), int(d), int(a0), int(a1), int(b0), int(b1))
    loc = exchange.local
    for r, a0, a1, b0, b1 in zip(loc.rank, loc.a0, loc.a1, loc.b0, loc.b1):
        copy(int(r), int(r), int(a0), int(a1), int(b0), int(b1))
    for rank, count in writes.items():
        assert (count == 1).all(), f"rank {rank}: elements written {count.min()}..{count.max()} times"
    return out


def _boxes(holders, full: np.ndarray) -> dict[int, np.ndarray]:
    return {int(r): full[a0:a1, b0:b1] for r, a0, a1, b0, b1 in
            zip(holders.rank, holders.a0, holders.a1, holders.b0, holders.b1)}


@settings(max_examples=300, deadline=None)
@given(boundaries(), st.integers(0, 2**31 - 1))
def test_forward_then_backward_is_exact_and_covers_every_element_once(case, seed) -> None:
    enc, llm, shape = case
    plan = plan_boundary(enc, llm, shape)
    full_shape = (shape.batch, shape.tokens, shape.hidden)
    x = np.random.default_rng(seed).standard_normal(full_shape)
    sent = _boxes(plan.forward.send_holders, x)
    received = _apply(plan.forward, sent, full_shape)
    for rank, value in _boxes(plan.forward.recv_holders, x).items():
        np.testing.assert_array_equal(received[rank], value)
    back = _apply(plan.backward, received, full_shape)
    assert back.keys() == sent.keys()
    for rank in sent:
        np.testing.assert_array_equal(back[rank], sent[rank])
    # The LLM's first stage receives; the encoder's last stage sends; everything else is idle.
    assert set(plan.forward.send_holders.rank) <= set(range(enc.offset + enc.tp * enc.cp * enc.dp * (enc.pp - 1),
                                                            enc.offset + enc.world))
    assert set(plan.forward.recv_holders.rank) <= set(range(llm.offset, llm.offset + llm.tp * llm.cp * llm.dp))


@settings(max_examples=100, deadline=None)
@given(boundaries())
def test_nothing_moves_when_both_sides_hold_the_same_boxes(case) -> None:
    enc, _, shape = case
    same = ModuleLayout("llm", enc.tp, 1, 1, enc.dp, enc.cp, first_rank=enc.first_rank)
    plan = plan_boundary(ModuleLayout("encoder", enc.tp, 1, 1, enc.dp, enc.cp, first_rank=enc.first_rank), same, shape)
    assert len(plan.forward.src) == 0 and len(plan.backward.src) == 0


def test_uneven_batch_worked_example() -> None:
    """The module docstring's example, element by element."""
    plan = plan_boundary(ModuleLayout("encoder", dp=4), ModuleLayout("llm", tp=2, dp=2), ActivationShape(5, 3, 2))
    views = [plan.forward.rank_view(r) for r in range(4)]
    assert [v.send_box for v in views] == [(0, 2, 0, 3), (2, 4, 0, 3), (4, 5, 0, 3), None]
    assert [v.recv_box for v in views] == [(0, 3, 0, 3), (0, 3, 0, 3), (3, 5, 0, 3), (3, 5, 0, 3)]
    assert views[0].recvs == ((1, ((2, 3, 0, 3),)),) and views[0].local == ((0, 2, 0, 3),)
    assert views[3].recvs == ((1, ((3, 4, 0, 3),)), (2, ((4, 5, 0, 3),))) and views[3].local == ()
    assert plan.fingerprint() == plan_boundary(ModuleLayout("encoder", dp=4), ModuleLayout("llm", tp=2, dp=2),
                                               ActivationShape(5, 3, 2)).fingerprint()


def test_bad_shapes_and_stages_are_refused_by_name() -> None:
    with pytest.raises(LayoutError, match="activation batch=0"):
        ActivationShape(0, 3, 2)
    with pytest.raises(LayoutError, match="stage 2 is not a pipeline stage of llm"):
        activation_holders(ModuleLayout("llm", pp=2), ActivationShape(4, 3, 2), 2)
