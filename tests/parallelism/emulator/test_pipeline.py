"""The simulator against textbook pipeline results."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from parallelism.emulator.network import collective_seconds
from parallelism.emulator.schedule import rank_orders
from parallelism.emulator.simulate import simulate
from parallelism.emulator.trace import CommOp

from .helpers import PROFILE, stage, timed, uniform_trace, with_stages

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(pp=st.integers(1, 12), m=st.integers(1, 40),
       f=st.floats(0.01, 5.0), b=st.floats(0.01, 5.0))
def test_1f1b_bubble_is_textbook_with_zero_communication(pp, m, f, b):
    result = simulate(uniform_trace(pp, m, forward=f, backward=b), PROFILE)
    assert result.step_seconds == pytest.approx((m + pp - 1) * (f + b), rel=1e-9)
    assert result.breakdown["bubble"] / result.step_seconds == pytest.approx((pp - 1) / (m + pp - 1), rel=1e-9, abs=1e-12)
    assert result.breakdown["compute"] == pytest.approx(m * (f + b), rel=1e-9)
    assert sum(result.breakdown.values()) == pytest.approx(result.step_seconds, rel=1e-12)
    for s in result.per_stage:  # every rank's breakdown sums to the step
        assert sum(s.breakdown.values()) == pytest.approx(result.step_seconds, rel=1e-12)


@FAST
@given(pp=st.integers(1, 12), m=st.integers(1, 40))
def test_1f1b_activations_in_flight(pp, m):
    result = simulate(uniform_trace(pp, m), PROFILE)
    for s in result.per_stage:
        assert s.in_flight == min(pp - s.stage, m)
        assert s.activations == 100 * s.in_flight
        assert s.peak == 10 + 20 + 30 + 100 * s.in_flight + 7
    assert result.peak_bytes == max(s.peak for s in result.per_stage)


@pytest.mark.parametrize("pp,m,vpp", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 4), (4, 12, 3)])
def test_interleaved_bubble_is_smaller_by_vpp(pp, m, vpp):
    plain = simulate(uniform_trace(pp, m), PROFILE).breakdown["bubble"]
    inter = simulate(uniform_trace(pp, m, vpp=vpp), PROFILE)
    assert inter.breakdown["bubble"] == pytest.approx(plain / vpp, rel=1e-9)
    assert inter.breakdown["compute"] == pytest.approx(m * 3.0, rel=1e-9)
    # Megatron's warm-up: rank r holds (pp-r-1)*2 + (vpp-1)*pp + 1 chunk forwards (all of them when m == pp)
    for s in inter.per_stage:
        warm = m * vpp if m == pp else min((pp - s.stage - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
        assert s.in_flight == warm


def test_interleaved_needs_divisible_micro_batches():
    with pytest.raises(ValueError, match="micro_batches=6 divisible by pp=4"):
        simulate(uniform_trace(4, 6, vpp=2), PROFILE)


@pytest.mark.parametrize("pp,vpp,m", [(1, 1, 5), (3, 1, 2), (4, 1, 9), (2, 2, 2), (4, 2, 4), (4, 3, 8)])
def test_orders_run_each_action_once_forward_first(pp, vpp, m):
    orders = rank_orders(pp, vpp, m)
    for order in orders:
        assert sorted(order) == sorted((k, mb, c) for k in "FB" for mb in range(m) for c in range(vpp))
        seen = set()
        for kind, mb, c in order:
            assert kind == "F" or ("F", mb, c) in seen
            seen.add((kind, mb, c))


def test_events_cover_every_action():
    result = simulate(uniform_trace(4, 8, vpp=2), PROFILE, record_events=True)
    assert [s.params for s in result.per_stage] == [2 * 10] * 4  # static state summed over a rank's chunks
    assert [s.temporary for s in result.per_stage] == [7] * 4    # temporaries: the largest chunk's
    data = json.loads(json.dumps(result.to_dict()))
    assert data["fits"] is True and len(data["per_stage"]) == 4 and len(data["events"]) == len(result.events)
    kinds = [e.kind for e in result.events]
    assert kinds.count("forward") == kinds.count("backward") == 4 * 2 * 8
    assert max(e.end for e in result.events) == pytest.approx(result.step_seconds)
    assert simulate(uniform_trace(4, 8), PROFILE).events == ()


def test_pipeline_transfers_are_on_the_critical_path():
    send = CommOp("act", "send", 64e6, 2, 2, "pp")
    recv = CommOp("act", "recv", 64e6, 2, 2, "pp")
    t = collective_seconds(send, PROFILE, 8)
    base = uniform_trace(2, 1)
    first = stage(0, forward=(timed("f", 1.0), send), backward=(recv, timed("b", 2.0)))
    last = stage(1, forward=(recv, timed("f", 1.0)), backward=(timed("b", 2.0), send))
    result = simulate(with_stages(base, [first, last]), PROFILE)
    assert result.step_seconds == pytest.approx(6.0 + 2 * t, rel=1e-9)
    for s in result.per_stage:  # each rank waits for one transfer: the activation in, or its gradient back
        assert s.breakdown["pp_comm"] == pytest.approx(t, rel=1e-9)
        assert s.breakdown["compute"] == pytest.approx(3.0, rel=1e-9)


def test_slowest_stage_sets_the_pace():
    base = uniform_trace(3, 12)
    stages = [stage(0), stage(1, forward=2.0, backward=4.0), stage(2)]
    result = simulate(with_stages(base, stages), PROFILE)
    assert result.critical_stage == 1
    assert result.per_stage[1].breakdown["bubble"] < result.per_stage[0].breakdown["bubble"]
    # steady state runs at the slow stage's rate: 12 micro-batches of 6 s each, plus fill and drain
    assert result.step_seconds >= 12 * 6.0
    assert result.step_seconds < 12 * 6.0 + 2 * 6.0 + 1e-9
