"""How a run's element-wise work runs, applied to a traced step (pure: no torch).

The traced program is eager PyTorch: its norms compute in fp32 over several kernels (a cast,
a square, a mean, an rsqrt, two multiplies, a cast back), RoPE over slices, a cat and
multiplies in fp32, the MLP's activation and product as kernels of their own, each reading
and writing memory. Megatron-Core with Transformer Engine runs one fused kernel for each of
those (TE's normalization kernels, `apply_rope_fusion`, `bias_swiglu_fusion` / TE's fused
activations, the residual add of bias-dropout-add), so a layer moves far fewer bytes.

- "program": as traced.
- "fused": every element-wise kernel of a decoder layer (the memory-bound ops between the
  GEMMs and attention of the forward and backward) is replaced by the fused kernels of
  Megatron-Core's layer, each moving its inputs and outputs once in bf16 (FUSED_LAYER).
  Kept as traced: the embedding, the loss, an FP8 run's casts (precision.py), the
  accumulation of gradients into fp32 buffers, the optimizer. Dense decoders only: an MoE
  layer's routing and token permutation are refused by name until they are modelled.

Per layer (t: the rank's tokens of the residual stream, T/tp under sequence parallelism;
T: its tokens in the tensor-parallel part; q, kv, f: the rank's query, key-value and MLP
widths; bytes of bf16):
- forward: two norms (read t h, write t h: 4 t h each), RoPE of q and k (read and write
  both: 4 T (q + kv)), two residual adds (read two, write one: 6 t h each), the activation
  (gated: read gate and up, write their product, 6 T f; not gated: 4 T f);
- backward: two norm backwards (read the input and the output gradient, write the input
  gradient: 6 t h each), RoPE's backward (as its forward), two residual gradient adds
  (6 t h each), the activation's backward (gated: read gate, up and the gradient, write two
  gradients, 10 T f; not gated: 6 T f).
The last stage's final norm adds one norm each way.
"""
from __future__ import annotations

import dataclasses

from parallelism.emulator.errors import EmulatorError, require
from parallelism.emulator.precision import CAST
from parallelism.emulator.trace import ComputeOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, expand_ops, with_ops

ELEMENTWISE = ("program", "fused")
# What fused element-wise work leaves as traced: the embedding and its gradient, the loss.
KEPT = ("embedding", "embedding_dense_backward", "_log_softmax", "_log_softmax_backward_data", "nll_loss_forward",
        "nll_loss_backward", CAST)
FUSED_LAYER = "fused_layer_elementwise"
FUSED_NORM = "fused_final_norm"


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """A decoder's widths (before tp), how its MLP runs, its vocabulary and experts: what the
    stack's fused kernels (here) and its memory (stack_memory.py) are sized by."""

    hidden: int
    q_width: int
    kv_width: int
    ffn: int
    gated: bool
    vocab: int = 0
    experts: int = 0

    @classmethod
    def of(cls, llm) -> "LayerShape":
        return cls(llm.hidden, llm.heads * llm.head_dim, llm.kv_heads * llm.head_dim, llm.ffn, llm.gated_mlp,
                   llm.vocab, llm.experts)


def with_elementwise(trace: Trace, mode: str, layer: LayerShape, sequence_parallel: bool = False) -> Trace:
    require(mode in ELEMENTWISE, f"elementwise={mode!r} not in {ELEMENTWISE}")
    if mode == "program":
        return trace
    if layer.experts:
        raise EmulatorError("--elementwise fused is modelled for dense decoders: an MoE layer's routing and "
                            "token permutation kernels are not (use --elementwise program)")
    if trace.inputs:
        raise EmulatorError("--elementwise fused is modelled for decoder-only models (this one has an encoder)")
    tokens = trace.micro_batch_size * trace.seq // trace.cp
    stream = tokens // trace.tp if sequence_parallel and trace.tp > 1 else tokens
    return each_stage(trace, lambda stage: _fused(stage, trace, layer, tokens, stream))


def _bytes(layer: LayerShape, tp: int, tokens: int, stream: int) -> tuple[float, float, float]:
    """(forward, backward, final norm) bytes of one layer's fused kernels on a rank."""
    h, q, kv, f = layer.hidden, layer.q_width / tp, layer.kv_width / tp, layer.ffn / tp
    e = 2  # bf16
    forward = e * (2 * 2 * stream * h + 2 * tokens * (q + kv) + 2 * 3 * stream * h
                   + (3 if layer.gated else 2) * tokens * f)
    backward = e * (2 * 3 * stream * h + 2 * tokens * (q + kv) + 2 * 3 * stream * h
                    + (5 if layer.gated else 3) * tokens * f)
    return forward, backward, e * 2 * stream * h


def _fused(stage: StageTrace, trace: Trace, layer: LayerShape, tokens: int, stream: int) -> StageTrace:
    forward, backward, norm = _bytes(layer, trace.tp, tokens, stream)

    def kernels(total: float) -> tuple[ComputeOp, ...]:
        # one op per layer with the layer's bytes: the kernels' launches are a few microseconds
        # against the bytes' time at these sizes, and one op keeps the trace short
        return (ComputeOp(FUSED_LAYER, "memory", total / 2, total, dtype="bf16"),)

    def dropped(op) -> bool:
        return isinstance(op, ComputeOp) and op.kind == "memory" and not op.role and op.name not in KEPT

    def attention(op) -> bool:
        return isinstance(op, ComputeOp) and op.kind == "attention"

    def edit(ops: tuple, total: float) -> tuple[tuple, list[int]]:
        # drop the traced element-wise kernels, then one fused set after each layer's attention
        out, at = expand_ops(ops, dropped, lambda op: ())
        more, at2 = expand_ops(out, attention, lambda op: (op, *kernels(total)))
        return more, [at2[i] for i in at]

    fwd, bwd = edit(stage.forward, forward), edit(stage.backward, backward)
    last = stage.stage == len(trace.stages) - 1
    if last:  # the final norm, forward and backward
        final = ComputeOp(FUSED_NORM, "memory", norm / 2, norm, dtype="bf16")
        fwd = ((*fwd[0], final), fwd[1])
        bwd = ((final, *bwd[0]), [i + 1 for i in bwd[1]])
    return with_ops(stage, forward=fwd, backward=bwd)
