"""Which attention kernels a run uses, applied to a traced step (pure: no torch).

The traced program runs fused (flash) attention: one kernel each way that keeps the s x s
scores on chip. Runs published before FlashAttention (Dao et al. 2022) ran "core attention"
unfused, as Megatron-LM did in Narayanan et al. 2021 and Korthikanti et al. 2022
(megatron/model/transformer.py, CoreAttention / ParallelAttention): a batched GEMM writes the
scores Q K^T to memory, a fused scale-mask-softmax kernel reads them and writes the
probabilities, dropout (Megatron's default attention_dropout is 0.1) reads those and writes
its output and a one-byte mask, and a second batched GEMM multiplies by V. The backward runs
the two GEMMs' gradients (four batched GEMMs), the dropout's and the softmax's.

`with_attention(trace, "unfused", dropout)` replaces every fused attention op of a traced
step by that kernel sequence: each GEMM is a matmul op of its batched shape (the device
model's rate for that shape; with k = head_dim they are often memory-bound on their s x s
output), each other kernel a memory-bound op moving its bytes. The GEMMs compute the whole
s x s square (Megatron masks after the GEMM); the memory of the s x s tensors (Korthikanti et
al.'s 5 a s^2 b bytes a layer with dropout, 2 a s^2 b without) is what a backward keeps without
recompute, and what selective recompute drops.
"""
from __future__ import annotations

import dataclasses

from parallelism.emulator.errors import require
from parallelism.emulator.trace import ComputeOp, Op, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, expand_ops, with_ops

ATTENTION_KERNELS = ("flash", "unfused")
# The unfused forward's kernels: what Megatron's selective recompute re-runs (stage_cost.py).
CORE_ATTENTION_FORWARD = ("attention_scores_bmm", "scaled_masked_softmax", "attention_dropout", "attention_context_bmm")
# Every kernel of it, forward and backward: each reads or writes the s x s scores or
# probabilities, so each runs at the bandwidth such kernels reach (devices.py, the A100's
# measured figure).
SCORE_KERNELS = CORE_ATTENTION_FORWARD + (
    "attention_grad_values_bmm", "attention_grad_probs_bmm", "attention_dropout_backward",
    "scaled_masked_softmax_backward", "attention_grad_query_bmm", "attention_grad_key_bmm")
_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def is_fused_attention(op: Op) -> bool:
    return isinstance(op, ComputeOp) and op.kind == "attention" and len(op.shape) == 5


def unfused_forward(shape: tuple[int, ...], dtype: str, dropout: float) -> tuple[ComputeOp, ...]:
    """Megatron's core attention forward for (batch, heads, seq_q, seq_kv, head_dim)."""
    b, a, sq, skv, d = shape
    e, n, bh = _BYTES[dtype], b * a * sq * skv, b * a
    q, kv = bh * sq * d * e, bh * skv * d * e
    ops = [ComputeOp("attention_scores_bmm", "matmul", 2.0 * n * d, q + kv + n * e, (bh, sq, skv, d), dtype, "nt"),
           ComputeOp("scaled_masked_softmax", "memory", 5.0 * n, 2.0 * n * e, (), dtype)]
    if dropout > 0:
        ops.append(ComputeOp("attention_dropout", "memory", 1.0 * n, n * (2.0 * e + 1), (), dtype))
    ops.append(ComputeOp("attention_context_bmm", "matmul", 2.0 * n * d, n * e + kv + q, (bh, sq, d, skv), dtype,
                         "nn"))
    return tuple(ops)


def unfused_backward(shape: tuple[int, ...], dtype: str, dropout: float) -> tuple[ComputeOp, ...]:
    """Its backward: the context GEMM's two gradients, dropout's and softmax's backward, the
    score GEMM's two gradients."""
    b, a, sq, skv, d = shape
    e, n, bh = _BYTES[dtype], b * a * sq * skv, b * a
    q, kv = bh * sq * d * e, bh * skv * d * e
    ops = [ComputeOp("attention_grad_values_bmm", "matmul", 2.0 * n * d, n * e + q + kv, (bh, skv, d, sq), dtype,
                     "tn"),
           ComputeOp("attention_grad_probs_bmm", "matmul", 2.0 * n * d, q + kv + n * e, (bh, sq, skv, d), dtype,
                     "nt")]
    if dropout > 0:
        ops.append(ComputeOp("attention_dropout_backward", "memory", 1.0 * n, n * (2.0 * e + 1), (), dtype))
    ops += [ComputeOp("scaled_masked_softmax_backward", "memory", 4.0 * n, 3.0 * n * e, (), dtype),
            ComputeOp("attention_grad_query_bmm", "matmul", 2.0 * n * d, n * e + kv + q, (bh, sq, d, skv), dtype,
                      "nn"),
            ComputeOp("attention_grad_key_bmm", "matmul", 2.0 * n * d, n * e + q + kv, (bh, skv, d, sq), dtype,
                      "tn")]
    return tuple(ops)


def kept_bytes(shape: tuple[int, ...], dtype: str, dropout: float) -> int:
    """s x s bytes the backward needs: the probabilities, and with dropout its mask and output."""
    b, a, sq, skv, _ = shape
    n, e = b * a * sq * skv, _BYTES[dtype]
    return int(n * (e + (1 + e if dropout > 0 else 0)))


def with_attention(trace: Trace, kernel: str, dropout: float = 0.0) -> Trace:
    """The trace with its fused attention ops run as `kernel` ("flash": unchanged)."""
    require(kernel in ATTENTION_KERNELS, f"attention={kernel!r} not in {ATTENTION_KERNELS}")
    require(isinstance(dropout, (int, float)) and 0 <= dropout < 1,
            f"attention_dropout={dropout!r} must be in [0, 1)")
    if kernel == "flash":
        return trace
    return each_stage(trace, lambda stage: _unfused_stage(stage, dropout))


def _unfused_stage(stage: StageTrace, dropout: float) -> StageTrace:
    attention = [op for op in stage.forward if is_fused_attention(op)]
    kept = sum(kept_bytes(op.shape, op.dtype, dropout) for op in attention)
    scores = max((2 * kept_bytes(op.shape, op.dtype, 0.0) for op in attention), default=0)
    memory = stage.memory
    memory = dataclasses.replace(
        memory, activations_per_microbatch=memory.activations_per_microbatch + kept,
        activations_selective=(memory.activations_per_microbatch if memory.activations_selective is None
                               else memory.activations_selective),
        temporary=max(memory.temporary, scores))
    return with_ops(stage,
                    forward=expand_ops(stage.forward, is_fused_attention,
                                       lambda op: unfused_forward(op.shape, op.dtype, dropout)),
                    backward=expand_ops(stage.backward, is_fused_attention,
                                        lambda op: unfused_backward(op.shape, op.dtype, dropout)),
                    memory=memory)
