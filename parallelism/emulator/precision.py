"""A run's GEMM precision, applied to a traced step (pure: no torch).

The traced program computes in bf16. FP8 training as Transformer Engine (Megatron-Core,
NeMo) and torchao's float8 (torchtitan) run it keeps the same graph and changes the linear
layers' GEMMs:

- Which GEMMs: the forward, input-gradient and weight-gradient GEMM of every linear layer
  of the decoder layers (attention projections, MLP, each expert). Attention's own matmuls
  (the flash kernel) stay bf16, as do the LM head (Megatron-Core's output layer is not a TE
  module; torchtitan's float8 converter skips `output`) and an MoE router (fp32 in both).
  Those GEMMs run at the device's FP8 rate (DeviceProfile.peak_flops["fp8"]), their
  operands one byte an element.
- The casts: before an FP8 GEMM its bf16 operands are cast, each with its transpose for the
  backward GEMM that reads it the other way round (TE's cast_transpose: reads 2 bytes,
  writes 1 + 1 an element). Forward: the input (once for the GEMMs that share it: q/k/v,
  gate/up, told by their widths: Dims.shared_inputs) and the weight (every micro-batch). Backward: the output gradient, shared by
  the input- and weight-gradient GEMMs (half its bytes priced before each). "current"
  scaling (torchao's default, TE's Float8CurrentScaling) computes each tensor's amax in a
  pass of its own first (2 bytes more an element); "delayed" (TE's DelayedScaling, the
  Megatron-Core default) takes the scale from an amax history kept by the cast kernel, and
  all-reduces the step's amaxes over the data- and tensor-parallel ranks once per forward
  (TE's reduce at fp8_autocast exit: one small all-reduce, here at the end of each stage's
  forward).
- Memory: the inputs the backward reads are kept as FP8 (1 byte an element instead of 2)
  where the forward's activations keep them (not under full recompute, which keeps only
  the layers' inputs); each FP8 GEMM's weight is kept as FP8 with its transpose (2 bytes a
  parameter) beside the bf16 weight, except under FSDP (zero=3), where a layer's gathered
  weights are transient. Masters, gradients and optimizer state keep their precision.

The GEMMs are told apart by shape (the trace has no module names): a linear layer's GEMMs
have the model's hidden size as one dimension. The head's three GEMMs have the dimensions
{tokens, vocab shard, hidden} in some order (tokens: a micro-batch's positions on the rank),
a router's {tokens, experts, hidden}; a linear layer's match those only if its width equals
the vocabulary shard or the expert count (it would then be kept in bf16; none of the
catalog's or the published runs' models has such a width). Sets of dimensions, not pairs:
a micro-batch's tokens may equal the vocabulary shard (32768 / tp=4 at seq 8192).
"""
from __future__ import annotations

import dataclasses
import math

from parallelism.emulator.errors import require
from parallelism.emulator.trace import CommOp, ComputeOp, StageMemory, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage, expand_ops, with_ops

PRECISIONS = ("bf16", "fp8")
FP8_SCALINGS = ("delayed", "current")
# Where the casts run: kernels of their own ("separate"), or as Transformer Engine runs them under
# Megatron-Core ("fused"): a norm writes its output as FP8 for the GEMMs after it (TE's
# LayerNormLinear / LayerNormMLP), the MLP's activation writes the second GEMM's input as FP8,
# and a weight is cast on a step's first micro-batch and reused by the others (Megatron-Core
# passes TE `is_first_microbatch`); only the attention output's cast and the backward's runs
# on their own.
FP8_CASTS = ("separate", "fused")
CAST = "fp8_cast_transpose"
AMAX = "fp8_amax_all_reduce"
_AMAX_BYTES_PER_GEMM = 3 * 4  # one fp32 amax for each of a GEMM's three cast tensors


@dataclasses.dataclass(frozen=True)
class Dims:
    """The model's sizes that tell its GEMMs apart."""

    hidden: int
    vocab: int
    experts: int = 0
    # Widths of the GEMMs that read one input together (before tp): q/k/v's and gate/up's
    # (an expert's too), each group a tuple. Empty: every GEMM casts its own input.
    shared_inputs: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, llm) -> "Dims":
        """The dims of a DecoderConfig."""
        attention = (llm.heads * llm.head_dim, llm.kv_heads * llm.head_dim)
        return cls(llm.hidden, llm.vocab, llm.experts, (attention, tuple(w for w in (llm.ffn, llm.moe_ffn) if w)))

    def group(self, width: int, tp: int) -> int | None:
        """Which shared-input group a GEMM of this output width (on a rank of tp) is in."""
        for index, widths in enumerate(self.shared_inputs):
            if any(width in (w // tp, math.ceil(w / tp), w) for w in widths):
                return index
        return None

    def kept_bf16(self, trace: Trace) -> list[list[int]]:
        """The sorted dimensions of the GEMMs that stay bf16: the head's and a router's."""
        tokens = trace.micro_batch_size * trace.seq // trace.cp
        widths = {self.vocab // trace.tp, math.ceil(self.vocab / trace.tp)} | ({self.experts} if self.experts else set())
        return [sorted((tokens, width, self.hidden)) for width in widths]


def with_precision(trace: Trace, precision: str, dims: Dims, scaling: str = "delayed",
                   gpus_per_node: int = 8, casts: str = "separate") -> Trace:
    require(precision in PRECISIONS, f"precision={precision!r} not in {PRECISIONS}")
    require(scaling in FP8_SCALINGS, f"fp8 scaling={scaling!r} not in {FP8_SCALINGS}")
    require(casts in FP8_CASTS, f"fp8 casts={casts!r} not in {FP8_CASTS}")
    if precision == "bf16":
        return trace
    amax_group = trace.tp * trace.cp * trace.dp
    amax_nodes = max(1, min(amax_group, math.ceil(amax_group / gpus_per_node)))
    return each_stage(trace, lambda stage: _fp8_stage(stage, trace, dims, scaling, amax_group, amax_nodes,
                                                      casts == "fused"))


def is_fp8_gemm(op, dims: Dims, trace: Trace) -> bool:
    """Whether FP8 training runs this traced op in FP8: a linear layer's GEMM (see above)."""
    if not (isinstance(op, ComputeOp) and op.kind == "matmul" and len(op.shape) == 3 and op.dtype == "bf16"):
        return False
    return dims.hidden in op.shape and sorted(op.shape) not in dims.kept_bf16(trace)


def _fp8(op: ComputeOp) -> ComputeOp:
    m, n, k = op.shape
    return dataclasses.replace(op, dtype="fp8", bytes=float(m * k + k * n + 2 * m * n))  # fp8 in, bf16 out


def _cast(elements: float, scaling: str) -> ComputeOp:
    per_element = 4 + (2 if scaling == "current" else 0)  # read 2, write fp8 + its transpose; current: amax pass
    return ComputeOp(CAST, "memory", float(elements), float(elements * per_element), dtype="fp8", source="bf16")


def _fp8_stage(stage: StageTrace, trace: Trace, dims: Dims, scaling: str, amax_group: int,
               amax_nodes: int, fused: bool = False) -> StageTrace:
    fp8 = lambda op: is_fp8_gemm(op, dims, trace)  # noqa: E731
    inputs: list[int] = []  # elements of each distinct input the forward's FP8 GEMMs read
    weights: list[int] = []
    step_casts: list[ComputeOp] = []  # fused: the weights' casts, once a step
    previous: tuple | None = None  # the last FP8 GEMM's (m, k, shared-input group)
    after_attention = False  # an attention op since the last FP8 GEMM: the next reads its output

    def forward(op: ComputeOp) -> tuple:
        nonlocal previous, after_attention
        m, n, k = op.shape
        weights.append(k * n)
        casts = [_cast(k * n, scaling)]
        if fused:
            step_casts.extend(casts)
            casts = []
        # q/k/v and gate/up read one input: it is cast once (the attention output's reader never shares)
        this = (m, k, None if after_attention else dims.group(n, trace.tp))
        if this[2] is None or this != previous:
            inputs.append(m * k)
            if not fused or after_attention:  # fused: norms and the activation write FP8; attention does not
                casts.insert(0, _cast(m * k, scaling))
        previous, after_attention = this, False
        return (*casts, _fp8(op))

    def matches(op) -> bool:
        nonlocal after_attention
        if isinstance(op, ComputeOp) and op.kind == "attention":
            after_attention = True
        return fp8(op)

    fwd = expand_ops(stage.forward, matches, forward)
    bwd = expand_ops(stage.backward, fp8, lambda op: (_cast(op.shape[0] * op.shape[2] / 2, scaling), _fp8(op)))
    if scaling == "delayed" and weights:
        amax = CommOp(AMAX, "all_reduce", float(_AMAX_BYTES_PER_GEMM * len(weights)), amax_group, amax_nodes, "dp")
        fwd = ((*fwd[0], amax), fwd[1])  # after the last op: positions before it are unchanged
    memory = _fp8_memory(stage.memory, sum(inputs), sum(weights), trace.zero)
    return with_ops(stage, forward=fwd, backward=bwd, memory=memory, optimizer=(*stage.optimizer, *step_casts))


def _fp8_memory(memory: StageMemory, input_elements: int, weight_elements: int, zero: int) -> StageMemory:
    """Inputs kept for the backward as FP8 (1 byte saved an element), FP8 weight copies (2 bytes a weight)."""
    saved = lambda value: value if value is None else max(0, value - input_elements)  # noqa: E731
    return dataclasses.replace(
        memory, params=memory.params + (0 if zero == 3 else 2 * weight_elements),
        activations_per_microbatch=saved(memory.activations_per_microbatch),
        activations_selective=saved(memory.activations_selective))
