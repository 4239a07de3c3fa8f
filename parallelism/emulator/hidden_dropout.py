"""Dropout on a run's residual stream, applied to a traced step (pure: no torch).

The traced program has no dropout. Megatron-LM's GPT (default --hidden-dropout 0.1) drops
out each sublayer's output inside its fused bias-dropout-add kernel: the forward also writes
a one-byte mask an element, and the backward runs a kernel of its own (reads the gradient
and the mask, writes the dropped gradient: 5 bytes an element in 16-bit), where the
program's residual add passes the gradient on without one. Two a layer (after attention,
after the MLP), on the rank's residual stream: b x s x h elements, s / tp with sequence
parallelism. Each layer has one attention op in the trace: the kernels are placed after it.
"""
from __future__ import annotations

from parallelism.emulator.attention_kernels import is_fused_attention
from parallelism.emulator.errors import require
from parallelism.emulator.trace import ComputeOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, expand_ops, with_ops

DROPOUTS_PER_LAYER = 2


def residual_elements(shape: tuple[int, ...], tp: int, sequence_parallel: bool) -> int:
    """Elements of a rank's residual stream, from its attention op's (b, heads, s, s_kv, d)."""
    b, heads, sq, _, d = shape
    return b * sq * heads * d * (1 if sequence_parallel else tp)


def with_hidden_dropout(trace: Trace, p: float, sequence_parallel: bool = False) -> Trace:
    require(isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1,
            f"hidden_dropout={p!r} must be in [0, 1)")
    if not p:
        return trace
    return each_stage(trace, lambda stage: _stage(stage, trace.tp, sequence_parallel))


def _stage(stage: StageTrace, tp: int, sequence_parallel: bool) -> StageTrace:
    def forward(op):
        n = residual_elements(op.shape, tp, sequence_parallel)
        return op, ComputeOp("hidden_dropout_masks", "memory", 0.0, DROPOUTS_PER_LAYER * n * 1.0, (), op.dtype)

    def backward(op):
        n = residual_elements(op.shape, tp, sequence_parallel)
        e = 4 if op.dtype == "fp32" else 2
        return op, ComputeOp("hidden_dropout_backward", "memory", DROPOUTS_PER_LAYER * n,
                             DROPOUTS_PER_LAYER * n * (2.0 * e + 1), (), op.dtype)

    return with_ops(stage, forward=expand_ops(stage.forward, is_fused_attention, forward),
                    backward=expand_ops(stage.backward, is_fused_attention, backward))
