"""Where a run accumulates its micro-batches' weight gradients, applied to a traced step
(pure: no torch).

The traced program adds each micro-batch's bf16 gradient into an fp32 buffer in a pass of
its own (ShardedAdamW.accumulate: 10 bytes a parameter per micro-batch, 6 for the first;
the tracer tags those ops "grad_accumulate"), as Megatron-LM's main_grad hook did. With
Megatron's gradient accumulation fusion (--gradient-accumulation-fusion, apex's
fused_weight_gradient_mlp_cuda, in Megatron-LM by early 2022: NVIDIA/apex#1312 and #1314,
March 2022) the weight-gradient GEMM adds its product into the fp32 buffer in its epilogue
(cuBLAS beta = 1), so no separate pass runs: the GEMM stays compute-bound, its fp32 output
read and written under its compute time.

- "program": as traced.
- "fused": the tagged ops dropped from every backward.
"""
from __future__ import annotations

from parallelism.emulator.errors import require
from parallelism.emulator.trace import ComputeOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, expand_ops, with_ops

GRAD_ACCUMULATIONS = ("program", "fused")


def with_grad_accumulation(trace: Trace, mode: str) -> Trace:
    require(mode in GRAD_ACCUMULATIONS, f"grad_accumulation={mode!r} not in {GRAD_ACCUMULATIONS}")
    return trace if mode == "program" else each_stage(trace, _fused)


def _fused(stage: StageTrace) -> StageTrace:
    return with_ops(stage, backward=expand_ops(stage.backward, _accumulates, lambda op: ()))


def _accumulates(op) -> bool:
    return isinstance(op, ComputeOp) and op.role == "grad_accumulate"
