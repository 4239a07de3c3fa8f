"""What a stack keeps in memory, applied to a traced step (pure: no torch).

The traced program is eager PyTorch: its backward keeps the fp32 intermediates of its norms
and RoPE, each MLP product, each cast, and its gradient buffers are fp32. Megatron-Core with
Transformer Engine keeps, per decoder layer without recompute (Korthikanti et al. 2022,
section 4.1's accounting, for a pre-norm decoder with flash attention and no dropout):
- each norm's input (2 t h bytes, twice) and each GEMM block's input, the norm's output,
  saved sequence-sharded under sequence parallelism and gathered again in the backward
  (2 t h, twice; 1 byte an element when FP8 keeps it as FP8);
- flash attention's q, k and v after RoPE and its output (2 T (2 q + 2 kv)), the output also
  as the output projection's FP8 input (1 T q) in an FP8 run;
- the MLP: its first GEMM's output (gated: gate and up, 4 T f; not gated: 2 T f) and the
  activation's output, the second GEMM's input (2 T f; FP8: 1 T f);
t: the residual stream's tokens on the rank (T / tp under sequence parallelism), T: its
tokens, q, kv, f: the rank's widths. The last stage adds the final norm's input and output
(4 t h) and the loss's fp32 softmax over the rank's vocabulary shard (4 T V / tp). Under full
recompute a layer keeps its input only (2 t h); selective recompute of core attention keeps
what no recompute keeps (flash attention has no s x s tensors to drop).

Gradients: Megatron-Core's main-gradient buffers in the parameters' dtype (bf16: 2 bytes a
parameter), as NeMo's recipes run them (grad_reduce_in_fp32 off): DGX Cloud's Llama 3.1 8B
recipe log (docs/published-runs-2024.md, E-2) shows 44.3 GB allocated between steps for
8.03 B parameters on 8 H100s with the distributed optimizer over 8 ranks: 5.5 bytes a
parameter = 2 (bf16 weights) + 2 (bf16 gradients) + 12 / 8 (fp32 master and moments).

Transient (above the kept activations at the peak): a layer's gathered input and its widest
GEMM output (2 T h + 2 T max(f_out, q + 2 kv), f_out the first MLP GEMM's output width), one
such pair in the forward and one in the backward; the last stage's logits in bf16 and their
fp32 gradient (6 T V / tp). The traced program's step transients (its gradients concatenated
for the all-reduce) are not Megatron's: its distributed optimizer reduce-scatters in place.

- "program": as traced.
- "megatron-core": the stage's activations, their full-recompute value, its gradient bytes
  and its transient as above; params and optimizer state as traced.
"""
from __future__ import annotations

import dataclasses

from parallelism.emulator.elementwise import LayerShape
from parallelism.emulator.errors import EmulatorError, require
from parallelism.emulator.trace import ComputeOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage

MEMORY_MODELS = ("program", "megatron-core")


def layer_activation_bytes(w: LayerShape, tp: int, tokens: int, stream: int, fp8: bool = False) -> float:
    """Bytes one Megatron-Core layer keeps for its backward (the module docstring)."""
    h, q, kv, f = w.hidden, w.q_width / tp, w.kv_width / tp, w.ffn / tp
    gemm_input = 1 if fp8 else 2
    norms = 2 * 2 * stream * h + 2 * gemm_input * stream * h
    attention = 2 * tokens * (2 * q + 2 * kv) + (tokens * q if fp8 else 0)
    mlp = 2 * tokens * (2 * f if w.gated else f) + gemm_input * tokens * f
    return norms + attention + mlp


def transient_bytes(w: LayerShape, tp: int, tokens: int) -> float:
    """A layer's transient at the peak, forward and backward (the module docstring)."""
    f_out = (2 if w.gated else 1) * w.ffn / tp
    return 2 * (2 * tokens * w.hidden + 2 * tokens * max(f_out, (w.q_width + 2 * w.kv_width) / tp))


def with_stack_memory(trace: Trace, model: str, widths: LayerShape, sequence_parallel: bool = False,
                      fp8: bool = False) -> Trace:
    require(model in MEMORY_MODELS, f"memory model={model!r} not in {MEMORY_MODELS}")
    if model == "program":
        return trace
    if trace.inputs or widths.experts:
        raise EmulatorError("--memory-model megatron-core is modelled for dense decoder-only models (an MoE "
                            "layer's dispatch buffers and an encoder are not)")
    tokens = trace.micro_batch_size * trace.seq // trace.cp
    stream = tokens // trace.tp if sequence_parallel and trace.tp > 1 else tokens
    per_layer = layer_activation_bytes(widths, trace.tp, tokens, stream, fp8)
    transient = transient_bytes(widths, trace.tp, tokens)
    last = len(trace.stages) - 1

    def edit(stage: StageTrace) -> StageTrace:
        layers = sum(isinstance(op, ComputeOp) and op.kind == "attention" for op in stage.forward)
        extra = (4 * stream * widths.hidden + 4 * tokens * widths.vocab / trace.tp) if stage.stage == last else 0
        kept = int(layers * per_layer + extra)
        full = int(layers * 2 * stream * widths.hidden + extra)
        logits = 6 * tokens * widths.vocab / trace.tp if stage.stage == last else 0
        m = stage.memory  # the traced grads are the program's fp32 buffers of the held parameters: halved
        return dataclasses.replace(stage, memory=dataclasses.replace(
            m, grads=m.grads // 2, activations_per_microbatch=kept, activations_selective=kept,
            activations_full=full, temporary=int(transient + logits), overlap=0))

    return each_stage(trace, edit)
