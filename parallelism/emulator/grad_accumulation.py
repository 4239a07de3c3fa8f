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

With several micro-batches the tracer records a steady-state backward, whose accumulation
adds into buffers an earlier micro-batch made. A step's first backward of each stage makes
them instead: `first_backward` prices it as it runs (the cast into a new fp32 buffer, 6
bytes a parameter against the add's 10). Priced as a steady-state one, llama-124m's first
backward at tp=2 came to 231 ms against 180 real, the second 231 against 207
(benchmarks.emulator_timeline, session 26).
"""
from __future__ import annotations

from dataclasses import replace

from parallelism.emulator.errors import require
from parallelism.emulator.trace import ComputeOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, expand_ops, with_ops

GRAD_ACCUMULATIONS = ("program", "fused")


def with_grad_accumulation(trace: Trace, mode: str) -> Trace:
    require(mode in GRAD_ACCUMULATIONS, f"grad_accumulation={mode!r} not in {GRAD_ACCUMULATIONS}")
    return trace if mode == "program" else each_stage(trace, _fused)


# bytes a parameter: the first micro-batch's cast (bf16 read, fp32 written) and a later one's
# add (fp32 read, bf16 read, fp32 written), as the recorder counts them
_CAST_BYTES, _ADD_BYTES = 6, 10


def first_backward(ops: tuple) -> tuple:
    """A step's first backward of a stage from its traced steady-state one: each tagged
    in-place add of a gradient into its fp32 buffer becomes the cast that makes the buffer
    (ShardedAdamW.accumulate), same place, same role. Ops of a backward traced as a first
    one (a step of one micro-batch) pass unchanged, as does everything else."""
    return tuple(replace(op, name="_to_copy", bytes=op.bytes * _CAST_BYTES / _ADD_BYTES)
                 if _accumulates(op) and op.name == "add_" else op for op in ops)


def _fused(stage: StageTrace) -> StageTrace:
    return with_ops(stage, backward=expand_ops(stage.backward, _accumulates, lambda op: ()))


def _accumulates(op) -> bool:
    return isinstance(op, ComputeOp) and op.role == "grad_accumulate"
