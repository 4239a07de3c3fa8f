"""A traced rank's memory (trace_build.stage_memory) and the peak the simulator makes of it."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from parallelism.emulator.emulate import memory_rows
from parallelism.emulator.simulate import simulate
from parallelism.emulator.trace_build import stage_memory

from .helpers import PROFILE, stage, uniform_trace, with_stages

SIZES = st.integers(0, 10**10)


@given(SIZES, SIZES, SIZES, SIZES, SIZES, SIZES, SIZES)
def test_one_micro_batch_peaks_at_the_traced_peak_above_the_static_state(params, grads, optimizer, activations,
                                                                          fwd_bwd_peak, step_extra, grads_live):
    """The oracle: one micro-batch, traced as it runs, peaks at the parameters and optimizer
    state plus the most live bytes the trace saw (the gradients are allocated in the step,
    so the recorder sees them), whether they come as the activations go (FSDP2) or not."""
    grads_live = min(grads_live, grads)  # what the backward leaves live is the rank's gradients at most
    step_peak = grads + step_extra  # the optimizer step begins with every gradient live
    memory = stage_memory({"params": params, "grads": grads, "optimizer": optimizer}, activations, fwd_bwd_peak,
                          step_peak, grads_live, full=0)
    assert memory.temporary == 0 or memory.overlap == 0
    result = simulate(with_stages(uniform_trace(1, 1), [stage(0, memory=memory)]), PROFILE)
    assert result.peak_bytes == params + optimizer + max(fwd_bwd_peak, step_peak)


def test_gradients_made_as_activations_go_come_off_the_peak_only_with_one_micro_batch_in_flight() -> None:
    # FSDP2-like: 100 of activations, 60 of gradients, the backward never held more than 120
    memory = stage_memory({"params": 1000, "grads": 60, "optimizer": 2000}, 100, 120, 90, 60, full=10)
    assert (memory.temporary, memory.overlap) == (0, 40)
    single = with_stages(uniform_trace(1, 1), [stage(0, memory=memory)])
    result = simulate(single, PROFILE)
    assert result.peak_bytes == 1000 + 2000 + 120
    # the rows `emulate` returns say why the peak is below its parts
    row = memory_rows(result, single)[0]
    assert row["overlap"] == 40
    assert row["params"] + row["grads"] + row["optimizer"] + row["activations"] + row["temporary"] - row["overlap"] \
        == row["peak"]
    # several micro-batches accumulate: the trace held the gradients then (overlap 0); one
    # traced with an overlap is not credited where two micro-batches' activations are held
    two_stages = with_stages(uniform_trace(2, 4), [stage(0, memory=memory), stage(1, memory=memory)])
    first = simulate(two_stages, PROFILE).per_stage[0]
    assert first.in_flight == 2 and first.peak == 1000 + 60 + 2000 + 2 * 100 and first.overlap == 0
    # nor under full recompute, whose activations are not the traced ones
    assert simulate(single, PROFILE, recompute="full").peak_bytes == 1000 + 60 + 2000 + 10
