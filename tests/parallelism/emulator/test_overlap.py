"""Data-parallel overlap, ZeRO syncs and recompute."""
from __future__ import annotations

import pytest

from parallelism.emulator.network import collective_seconds
from parallelism.emulator.simulate import simulate
from parallelism.emulator.trace import CommOp, StageMemory

from .helpers import PROFILE, stage, timed, uniform_trace, with_stages

MS = 1e-3


def _bucket(seconds: float) -> CommOp:
    """A dp all-reduce over 8 nodes (one rank each, a ring at the NIC) that takes `seconds`."""
    latency = 2 * 7 * PROFILE.inter_node_latency
    op = CommOp("g", "all_reduce", (seconds - latency) * PROFILE.inter_bw * 8 / (2 * 7), 8, 8, "dp")
    assert collective_seconds(op, PROFILE) == pytest.approx(seconds, rel=1e-9)
    return op


def _dp_trace(bucket: CommOp, after: int, m: int = 3):
    backward = tuple(timed(f"b{i}", 1 * MS) for i in range(10))
    s = stage(0, forward=4 * MS, backward=backward, grad_sync=(bucket,), grad_sync_after=(after,))
    return with_stages(uniform_trace(1, m), [s])


def test_dp_sync_hidden_when_the_backward_outlasts_it():
    bucket = _bucket(5 * MS)
    result = simulate(_dp_trace(bucket, after=2), PROFILE)  # issued at 2 ms of a 10 ms backward
    assert collective_seconds(bucket, PROFILE) < 8 * MS
    assert result.breakdown["dp_comm"] == 0.0
    assert result.step_seconds == pytest.approx(3 * 14 * MS)


def test_dp_sync_exposed_beyond_the_remaining_backward():
    bucket = _bucket(20 * MS)
    t = collective_seconds(bucket, PROFILE)
    result = simulate(_dp_trace(bucket, after=2), PROFILE)
    exposed = 2 * MS + t - 10 * MS
    assert result.breakdown["dp_comm"] == pytest.approx(exposed, rel=1e-9)
    assert result.step_seconds == pytest.approx(3 * 14 * MS + exposed, rel=1e-9)


def test_default_buckets_spread_over_the_backward_and_queue_on_one_stream():
    buckets = tuple(_bucket(3 * MS) for _ in range(5))
    t = collective_seconds(buckets[0], PROFILE)
    backward = tuple(timed(f"b{i}", 1 * MS) for i in range(10))
    s = stage(0, forward=0.0, backward=backward, grad_sync=buckets)  # issued after ops 2, 4, 6, 8, 10
    result = simulate(with_stages(uniform_trace(1, 1), [s]), PROFILE, record_events=True)
    syncs = [e for e in result.events if e.kind == "grad_sync"]
    assert [e.start / MS for e in syncs] == pytest.approx([2.0, 5.0, 8.0, 11.0, 14.0])  # ready at 2, 4, .. 10
    assert result.step_seconds == pytest.approx(2 * MS + 5 * t, rel=1e-9)
    assert result.breakdown["dp_comm"] == pytest.approx(7 * MS, rel=1e-9)


def test_each_microbatch_sync_runs_m_times():
    bucket = _bucket(20 * MS)
    t = collective_seconds(bucket, PROFILE)
    backward = tuple(timed(f"b{i}", 1 * MS) for i in range(10))
    s = stage(0, forward=4 * MS, backward=backward, grad_sync=(bucket,), grad_sync_after=(10,),
              grad_sync_each_microbatch=True)
    result = simulate(with_stages(uniform_trace(1, 2), [s]), PROFILE)
    # first sync starts at 14 ms and runs under the second micro-batch; the second queues behind it
    assert result.step_seconds == pytest.approx(14 * MS + 2 * t, rel=1e-9)


def test_zero1_step_all_gather_is_exposed_after_the_optimizer():
    gather = CommOp("params", "all_gather", 1e9, 8, 8, "dp")
    t = collective_seconds(gather, PROFILE)
    s = stage(0, optimizer=(timed("adam", 3 * MS),), param_sync=(gather,))
    result = simulate(with_stages(uniform_trace(1, 2), [s]), PROFILE, record_events=True)
    assert result.step_seconds == pytest.approx(6.0 + 3 * MS + t, rel=1e-9)
    assert result.breakdown["dp_comm"] == pytest.approx(t, rel=1e-9)
    assert result.breakdown["compute"] == pytest.approx(6.0 + 3 * MS, rel=1e-9)
    assert [e.kind for e in result.events][-2:] == ["optimizer", "param_sync"]


@pytest.mark.parametrize("gather_ms,expected_ms", [(0.5, 4.5), (2.0, 9.0)])
def test_zero3_gathers_prefetch_one_ahead(gather_ms, expected_ms):
    gather = _bucket(gather_ms * MS)
    t = collective_seconds(gather, PROFILE)
    forward = tuple(timed(f"f{i}", 1 * MS) for i in range(4))
    s = stage(0, forward=forward, backward=0.0, param_sync=(gather,) * 4, param_sync_phase=("forward",) * 4,
              param_sync_at=(0, 1, 2, 3))
    result = simulate(with_stages(uniform_trace(1, 1), [s]), PROFILE)
    # slow gathers: the forward is gather-bound (4 t + last op); fast ones: only the first is exposed
    expected = 4 * t + 1 * MS if t > 1 * MS else t + 4 * MS
    assert result.step_seconds == pytest.approx(expected, rel=1e-9)
    assert expected == pytest.approx(expected_ms * MS, rel=1e-3)
    assert result.breakdown["dp_comm"] == pytest.approx(expected - 4 * MS, rel=1e-9)


def test_recompute_full_reruns_the_forward_selective_only_attention():
    forward = (timed("qkv", 1.0), timed("attn", 0.5, kind="attention"), timed("mlp", 1.5))
    memory = StageMemory(0, 0, 0, 1000, 0, activations_selective=600, activations_full=50)
    s = stage(0, forward=forward, backward=4.0, memory=memory)
    trace = with_stages(uniform_trace(1, 4), [s])
    none, sel, full = (simulate(trace, PROFILE, recompute=r) for r in ("none", "selective", "full"))
    assert none.step_seconds == pytest.approx(4 * 7.0)
    assert sel.step_seconds == pytest.approx(4 * 7.5)
    assert full.step_seconds == pytest.approx(4 * 10.0)
    assert [r.per_stage[0].activations for r in (none, sel, full)] == [1000, 600, 50]


def test_untraced_recompute_memory_falls_back_to_no_recompute():
    trace = uniform_trace(2, 4)
    full = simulate(trace, PROFILE, recompute="full")
    assert [s.activations for s in full.per_stage] == [200, 100]


def test_tp_collectives_are_inline():
    ar = CommOp("tp", "all_reduce", 64e6, 8, 1, "tp")
    t = collective_seconds(ar, PROFILE)
    s = stage(0, forward=(timed("f", 1.0), ar), backward=(timed("b", 2.0), ar))
    result = simulate(with_stages(uniform_trace(1, 3), [s]), PROFILE)
    assert result.step_seconds == pytest.approx(3 * (3.0 + 2 * t))
    assert result.breakdown["tp_comm"] == pytest.approx(3 * 2 * t)


def test_bad_simulation_inputs():
    trace = uniform_trace(2, 2)
    with pytest.raises(ValueError, match="recompute='partial'"):
        simulate(trace, PROFILE, recompute="partial")
    with pytest.raises(ValueError, match="gpus_per_node=0"):
        simulate(trace, PROFILE, gpus_per_node=0)
    with pytest.raises(ValueError, match="profile must be a DeviceProfile"):
        simulate(trace, "h100")


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5, 1.0])
def test_partial_overlap_hides_that_share_of_the_concurrent_compute(overlap):
    """comm_overlap = f: a bucket issued at 2 ms of a 10 ms backward advances f s per s of
    the remaining 8 ms of compute, then runs at full speed: exposed = max(0, t - 8 f) (or 0
    when it fits, finishing at 2 + t / f)."""
    from dataclasses import replace

    profile = replace(PROFILE, comm_overlap=overlap)
    bucket = _bucket(5 * MS)
    t = collective_seconds(bucket, PROFILE)
    result = simulate(_dp_trace(bucket, after=2), profile)
    exposed = max(0.0, t - 8 * MS * overlap) if t > 8 * MS * overlap else 0.0
    assert result.breakdown["dp_comm"] == pytest.approx(exposed, abs=1e-12)
    assert result.step_seconds == pytest.approx(3 * 14 * MS + exposed, rel=1e-9)


@pytest.mark.parametrize("overlap", [0.0, 0.5])
def test_zero3_gathers_hide_only_the_overlapped_share(overlap):
    """Four 2 ms gathers before four 1 ms ops: the first waits in full; each next one was
    issued when the previous was consumed and advanced `overlap` ms during the op between."""
    from dataclasses import replace

    gather = _bucket(2 * MS)
    t = collective_seconds(gather, PROFILE)
    forward = tuple(timed(f"f{i}", 1 * MS) for i in range(4))
    s = stage(0, forward=forward, backward=0.0, param_sync=(gather,) * 4, param_sync_phase=("forward",) * 4,
              param_sync_at=(0, 1, 2, 3))
    result = simulate(with_stages(uniform_trace(1, 1), [s]), replace(PROFILE, comm_overlap=overlap))
    expected = t + 3 * (t - overlap * MS) + 4 * MS
    assert result.step_seconds == pytest.approx(expected, rel=1e-9)


def test_comm_overlap_outside_zero_to_one_is_refused():
    from dataclasses import replace

    from parallelism.emulator.errors import EmulatorError

    with pytest.raises(EmulatorError, match="comm_overlap=1.5 must be in"):
        replace(PROFILE, comm_overlap=1.5)
    with pytest.raises(EmulatorError, match="comm_streams='no' must be true or false"):
        replace(PROFILE, comm_streams="no")


@pytest.mark.parametrize("each_microbatch", [False, True])
def test_without_comm_streams_every_dp_collective_is_in_series_with_compute(each_microbatch):
    """A CPU (comm_streams False): gathers and gradient buckets block the thread that issues
    them, so the step is the sum of everything, even where a GPU would hide the bucket and
    the gathers behind the backward and the next micro-batch's forward."""
    from dataclasses import replace

    bucket, gather = _bucket(5 * MS), _bucket(2 * MS)
    t_bucket, t_gather = collective_seconds(bucket, PROFILE), collective_seconds(gather, PROFILE)
    forward = tuple(timed(f"f{i}", 1 * MS) for i in range(4))
    backward = tuple(timed(f"b{i}", 1 * MS) for i in range(10))
    s = stage(0, forward=forward, backward=backward, grad_sync=(bucket,), grad_sync_after=(2,),
              grad_sync_each_microbatch=each_microbatch, param_sync=(gather,) * 2,
              param_sync_phase=("forward", "backward"), param_sync_at=(1, 3))
    m = 3
    trace = with_stages(uniform_trace(1, m), [s])
    streams = simulate(trace, PROFILE)
    serial = simulate(trace, replace(PROFILE, comm_streams=False))
    buckets = m if each_microbatch else 1
    expected = m * (14 * MS + 2 * t_gather) + buckets * t_bucket
    assert serial.step_seconds == pytest.approx(expected, rel=1e-9)
    assert serial.breakdown["dp_comm"] == pytest.approx(m * 2 * t_gather + buckets * t_bucket, rel=1e-9)
    assert streams.step_seconds < serial.step_seconds  # the same trace with streams hides some of it
