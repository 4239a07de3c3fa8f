"""The trace interface: validation and JSON."""
from __future__ import annotations

import pytest

from parallelism.emulator.trace import CommOp, ComputeOp, StageMemory, StageTrace, Trace

from .helpers import stage, timed, uniform_trace, with_stages


def _rich_trace() -> Trace:
    ar = CommOp("tp_ar", "all_reduce", 1e6, 8, 1, "tp")
    gather = CommOp("fsdp_ag", "all_gather", 2e6, 4, 4, "dp")
    rs = CommOp("fsdp_rs", "reduce_scatter", 4e6, 4, 4, "dp")
    send = CommOp("act", "send", 3e5, 2, 2, "pp")
    mm = ComputeOp("qkv", "matmul", 1e9, 1e6, (4096, 1536, 4096))
    attn = ComputeOp("sdpa", "attention", 2e9, 1e6, (1, 4, 4096, 4096, 128))
    stages = [StageTrace(k, (mm, attn, ar, send), (send, attn, mm, ar), (timed("adam", 1e-3),), (rs,),
                         (gather, gather, gather), StageMemory(1, 2, 3, 4, 5, 3, 1), grad_sync_after=(4,),
                         grad_sync_each_microbatch=True, param_sync_phase=("forward", "backward", "step"),
                         param_sync_at=(0, 2, 0))
              for k in range(4)]
    return Trace("llama3-8b", tp=8, pp=2, dp=4, micro_batches=4, micro_batch_size=2, seq=4096, stages=stages,
                 vpp=2, zero=3)


def test_json_round_trip():
    trace = _rich_trace()
    again = Trace.from_json(trace.to_json())
    assert again == trace
    assert again.stages[0].forward[0].shape == (4096, 1536, 4096)
    assert trace.world == 64 and trace.global_batch == 32 and trace.tokens_per_step == 32 * 4096


def test_bad_traces_name_the_value():
    with pytest.raises(ValueError, match="micro_batches=0"):
        uniform_trace(2, 0)
    with pytest.raises(ValueError, match="tp=-1"):
        Trace("x", tp=-1, pp=1, dp=1, micro_batches=1, micro_batch_size=1, seq=1, stages=[stage(0)])
    with pytest.raises(ValueError, match="3 stages traced, the layout has pp\\*vpp=2"):
        Trace("x", tp=1, pp=2, dp=1, micro_batches=1, micro_batch_size=1, seq=1, stages=[stage(i) for i in range(3)])
    with pytest.raises(ValueError, match="stages\\[1\\] has stage=0"):
        with_stages(uniform_trace(2, 1), [stage(0), stage(0)])
    with pytest.raises(ValueError, match="zero=4"):
        uniform_trace(1, 1, zero=4)
    with pytest.raises(ValueError, match="flops=-1"):
        ComputeOp("x", "matmul", -1, 0)
    with pytest.raises(ValueError, match="bytes=nan"):
        ComputeOp("x", "memory", 0, float("nan"))
    with pytest.raises(ValueError, match="kind='conv'"):
        ComputeOp("x", "conv", 1, 1)
    with pytest.raises(ValueError, match="activations_per_microbatch=-3"):
        StageMemory(0, 0, 0, -3, 0)
    with pytest.raises(ValueError, match="grad_sync_after=\\(5,\\) must lie in 0..1"):
        stage(0, grad_sync=(CommOp("g", "all_reduce", 1, 2, 1, "dp"),), grad_sync_after=(5,))
    with pytest.raises(ValueError, match="param_sync_phase 'later'"):
        stage(0, param_sync=(CommOp("g", "all_gather", 1, 2, 1, "dp"),), param_sync_phase=("later",))
    with pytest.raises(ValueError, match="op type 'kernel'"):
        Trace.from_dict({**uniform_trace(1, 1).to_dict(),
                         "stages": [{**uniform_trace(1, 1).to_dict()["stages"][0], "forward": [{"op": "kernel"}]}]})
    with pytest.raises(ValueError, match="trace is not JSON"):
        Trace.from_json("{")
