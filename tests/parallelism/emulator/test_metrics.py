"""Throughput metrics and a scale check of the simulator's cost."""
from __future__ import annotations

import time

import pytest

from parallelism.emulator.devices import get_profile
from parallelism.emulator.metrics import (hardware_tflops_per_gpu, mfu, model_flops_per_token, model_tflops_per_gpu,
                                     stage_flops, tokens_per_second)
from parallelism.emulator.simulate import simulate
from parallelism.emulator.trace import CommOp, ComputeOp, StageMemory, StageTrace, Trace

from .helpers import stage, uniform_trace, with_stages


def test_model_flops_palm_convention():
    assert model_flops_per_token(1e9, 10, 1000, 2000) == 6e9 + 12 * 10 * 1000 * 2000
    assert model_flops_per_token(1e9, 10, 1000, 2000, causal=True) == 6e9 + 6 * 10 * 1000 * 2000
    with pytest.raises(ValueError, match="params=0"):
        model_flops_per_token(0, 1, 1, 1)


def test_throughput_and_mfu():
    tps = tokens_per_second(512, 4096, 2.0)
    assert tps == 512 * 4096 / 2.0
    tflops = model_tflops_per_gpu(6e9, tps, 64)
    assert tflops == pytest.approx(6e9 * tps / 64 / 1e12)
    assert mfu(494.7, get_profile("h100")) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="step_seconds=0"):
        tokens_per_second(1, 1, 0)


def test_hardware_flops_count_recompute():
    forward = (ComputeOp("mm", "matmul", 3e12, 0), ComputeOp("attn", "attention", 1e12, 0))
    backward = (ComputeOp("mm_b", "matmul", 8e12, 0),)
    trace = with_stages(uniform_trace(2, 4), [stage(0, forward=forward, backward=backward), stage(1)])
    assert stage_flops(trace)[0] == 4 * 12e12
    assert stage_flops(trace, "selective")[0] == 4 * 13e12
    assert stage_flops(trace, "full")[0] == 4 * 16e12
    assert hardware_tflops_per_gpu(trace, 2.0) == pytest.approx(4 * 12e12 / 2 / 2.0 / 1e12)


def _big_trace(pp=16, m=64, layers_per_stage=8) -> Trace:
    """A llama3-405b-sized step at tp=8, pp=16, dp=64: ~200 ops per stage."""
    ar = CommOp("tp_ar", "all_reduce", 2 * 8192 * 16384, 8, 1, "tp")
    layer_f = [ComputeOp("qkv", "matmul", 2 * 8192 * 16384 * 2560, 1e8, (8192, 2560, 16384)),
               ComputeOp("attn", "attention", 4 * 8192 * 8192 * 2048, 1e8, (1, 16, 8192, 8192, 128)),
               ComputeOp("o", "matmul", 2 * 8192 * 2048 * 16384, 1e8, (8192, 16384, 2048)), ar,
               ComputeOp("norm", "memory", 1e8, 5e8),
               ComputeOp("up", "matmul", 2 * 8192 * 16384 * 13312, 1e8, (8192, 13312, 16384)),
               ComputeOp("down", "matmul", 2 * 8192 * 6656 * 16384, 1e8, (8192, 16384, 6656)), ar]
    send = CommOp("act", "send", 2 * 8192 * 16384, 2, 2, "pp")
    recv = CommOp("act", "recv", 2 * 8192 * 16384, 2, 2, "pp")
    stages = []
    for k in range(pp):
        forward = ([recv] if k else []) + layer_f * layers_per_stage + ([send] if k < pp - 1 else [])
        backward = ([recv] if k < pp - 1 else []) + layer_f * 2 * layers_per_stage + ([send] if k else [])
        grads = tuple(CommOp("grad", "all_reduce", 4 * 1.6e9 / 8, 64, 64, "dp") for _ in range(layers_per_stage))
        stages.append(StageTrace(k, forward, backward, (ComputeOp("adam", "memory", 1e9, 2e10),), grads, (),
                                 StageMemory(5 * 10**9, 10 * 10**9, 20 * 10**9, 4 * 10**9, 10**9)))
    return Trace("llama3-405b", tp=8, pp=pp, dp=64, micro_batches=m, micro_batch_size=1, seq=8192,
                 stages=stages, zero=1)


def test_a_large_configuration_simulates_fast_and_sensibly():
    trace = _big_trace()
    started = time.perf_counter()
    result = simulate(trace, get_profile("h100"), recompute="none", record_events=True)
    assert time.perf_counter() - started < 2.0
    b = result.breakdown
    assert sum(b.values()) == pytest.approx(result.step_seconds)
    assert all(v >= 0 for v in b.values()) and b["compute"] > b["tp_comm"] > 0 and b["bubble"] > 0
    hw = hardware_tflops_per_gpu(trace, result.step_seconds)
    assert 200 < hw < 989.4  # an H100 runs this step well below its peak
    assert result.per_stage[0].in_flight == 16 and not result.fits  # 16 x 4 GB activations + 36 GB > 80 GiB
