"""Throughput metrics of a simulated step (the `dynaplane emulate` JSON keys).

Model FLOPs follow the PaLM appendix convention (Chowdhery et al. 2022, arXiv 2204.02311,
appendix B): 6 N per token for the weights' matmuls in forward + backward, plus
12 L d_attn s per token for attention scores and values (full s x s, causal masking not
subtracted unless `causal=True`), no recompute. N counts the parameters that take part
in a matmul for a token: the output head yes, the input embedding (a lookup) no; for MoE
only the experts a token is routed to. Hardware FLOPs are what the trace runs, including
recompute.
"""
from __future__ import annotations

import math

from parallelism.emulator.devices import DeviceProfile
from parallelism.emulator.errors import require
from parallelism.emulator.stage_cost import RECOMPUTE, recomputed_ops
from parallelism.emulator.trace import ComputeOp, Trace


def _positive(value: float, what: str) -> None:
    require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0,
            f"{what}={value!r} must be a positive number")


def model_flops_per_token(params: float, layers: int, attention_width: int, seq: int, causal: bool = False) -> float:
    """6 N + 12 L d_attn s (d_attn = heads * head_dim)."""
    _positive(params, "params")
    for key, value in (("layers", layers), ("attention_width", attention_width), ("seq", seq)):
        _positive(value, key)
    attention = 12.0 * layers * attention_width * seq
    return 6.0 * params + (attention / 2 if causal else attention)


def tokens_per_second(global_batch: int, seq: int, step_seconds: float) -> float:
    _positive(global_batch, "global_batch")
    _positive(seq, "seq")
    _positive(step_seconds, "step_seconds")
    return global_batch * seq / step_seconds


def model_tflops_per_gpu(flops_per_token: float, tokens_per_s: float, gpus: int) -> float:
    _positive(gpus, "gpus")
    return flops_per_token * tokens_per_s / gpus / 1e12


def stage_flops(trace: Trace, recompute: str = "none") -> list[float]:
    """FLOPs one rank of each pipeline rank runs per step (forward, backward, recompute
    for every micro-batch, plus the optimizer), summed over its chunks."""
    require(recompute in RECOMPUTE, f"recompute={recompute!r} not in {RECOMPUTE}")

    def flops(ops) -> float:
        return sum(op.flops for op in ops if isinstance(op, ComputeOp))

    per_rank = [0.0] * trace.pp
    for k, stage in enumerate(trace.stages):
        per_mb = flops(stage.forward) + flops(stage.backward) + flops(recomputed_ops(stage, recompute))
        per_rank[k % trace.pp] += trace.micro_batches * per_mb + flops(stage.optimizer)
    return per_rank


def hardware_tflops_per_gpu(trace: Trace, step_seconds: float, recompute: str = "none") -> float:
    """Mean over pipeline ranks (TP/DP replicas are identical) of FLOPs run per second."""
    _positive(step_seconds, "step_seconds")
    per_rank = stage_flops(trace, recompute)
    return sum(per_rank) / len(per_rank) / step_seconds / 1e12


def _ops_flops(ops) -> float:
    return sum(op.flops for op in ops if isinstance(op, ComputeOp))


def module_flops(trace: Trace, recompute: str = "none") -> dict[str, float]:
    """FLOPs the traced ops run in a step, all ranks of each module together ("llm": the
    pipeline; an input module's forward is run twice under full recompute)."""
    out = {"llm": sum(stage_flops(trace, recompute)) * trace.tp * trace.dp}
    for item in trace.inputs:
        e = item.stage
        out[item.module] = (_ops_flops(e.forward) * (2 if recompute == "full" else 1) + _ops_flops(e.backward)
                            + _ops_flops(e.optimizer)) * item.world
    return out


def mfu(model_tflops: float, profile: DeviceProfile, dtype: str = "bf16") -> float:
    """Model FLOPs utilization: model TFLOP/s per GPU over the device's dense peak."""
    return model_tflops * 1e12 / profile.peak(dtype)
