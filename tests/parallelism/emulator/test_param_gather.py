"""Overlapped parameter all-gathers (param_gather.py, Megatron-Core's overlap_param_gather):
a step's ZeRO-1 gathers run beside the next step's first forward, against the step priced by
hand on stages of chosen seconds."""
from __future__ import annotations

import pytest

from parallelism.emulator.costs import op_seconds
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.param_gather import with_param_gather
from parallelism.emulator.simulate import simulate
from parallelism.emulator.trace import CommOp
from tests.parallelism.emulator.helpers import PROFILE, stage, uniform_trace, with_stages


def _with_gather(seconds_of_bytes: float, m: int = 1, pp: int = 1):
    gather = CommOp("zero1_param_gather", "all_gather", seconds_of_bytes, 8, 1, "dp")
    trace = uniform_trace(pp, m)
    stages = [stage(i, 1.0, 2.0, param_sync=(gather,), param_sync_phase=("step",)) for i in range(pp)]
    return with_stages(trace, stages), op_seconds(gather, PROFILE, 8)


@pytest.mark.parametrize("nbytes", [1e9, 1e12])
def test_the_gather_runs_beside_the_first_forward(nbytes: float) -> None:
    trace, g = _with_gather(nbytes)
    exposed = simulate(trace, PROFILE).step_seconds
    overlapped = simulate(with_param_gather(trace, "overlapped"), PROFILE).step_seconds
    assert exposed == pytest.approx(1.0 + 2.0 + g)
    assert overlapped == pytest.approx(max(1.0, g) + 2.0)  # hidden when shorter than the forward


def test_only_the_first_micro_batch_waits_and_the_wait_is_data_parallel_time() -> None:
    trace, g = _with_gather(1e12, m=4)
    assert g > 1.0
    result = simulate(with_param_gather(trace, "overlapped"), PROFILE)
    assert result.step_seconds == pytest.approx(g + 2.0 + 3 * 3.0)
    assert result.breakdown["dp_comm"] == pytest.approx(g - 1.0)


def test_unknown_mode_is_refused() -> None:
    trace, _ = _with_gather(1e9)
    with pytest.raises(EmulatorError, match=r"param_gather='prefetch' not in \('step', 'overlapped'\)"):
        with_param_gather(trace, "prefetch")
