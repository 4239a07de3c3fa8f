"""FP8 training as a run setting (parallelism/emulator/precision.py): which GEMMs run in FP8,
what the casts and the amax reduction cost, what memory changes; and `dynaplane emulate
--precision` end to end. Oracles: the model's own tensor list (which linear layers a rank
holds and their shard sizes) and a hand-built trace where a micro-batch's tokens equal the
vocabulary shard."""
from __future__ import annotations

import math

import pytest

from parallelism.emulator.devices import get_profile
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.precision import AMAX, CAST, Dims, is_fp8_gemm, with_precision
from parallelism.emulator.trace import ComputeOp, StageMemory, Trace
from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.layout.catalog import get_config, get_model
from tests.parallelism.emulator.helpers import stage

pytestmark = pytest.mark.timeout(300)

SEQ = 32


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _traced(model: str, layout: str) -> tuple[Trace, Dims]:
    traced, _ = trace(TraceRequest(model, layout, 1, SEQ, 1, 8, False))
    return traced, Dims.of(get_config(model).llm)


def _linear_weights(model: str, tp: int) -> tuple[int, int]:
    """(GEMMs, weight elements) of one rank's linear layers in one forward: every 2-D weight of a
    layer but a router's, one GEMM each, and each expert's weight of a 3-D expert tensor."""
    gemms = elements = 0
    for t in get_model(model).tensors:
        if t.split.layer is None or len(t.shape) < 2 or ".router." in t.name:
            continue
        experts = t.shape[0] if len(t.shape) == 3 else 1
        gemms += experts
        elements += math.prod(t.shape) // (tp if t.split.tp_dim is not None else 1)
    return gemms, elements


def _gemms(ops, dtype: str) -> list[ComputeOp]:
    return [op for op in ops if isinstance(op, ComputeOp) and op.kind == "matmul" and op.dtype == dtype]


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe"])
def test_every_linear_gemm_runs_in_fp8_and_the_head_router_and_attention_stay_bf16(model: str) -> None:
    traced, dims = _traced(model, "tp=2")
    fp8 = with_precision(traced, "fp8", dims, "delayed").stages[0]
    bf16 = traced.stages[0]
    gemms, weight_elements = _linear_weights(model, tp=2)
    assert len(_gemms(fp8.forward, "fp8")) == gemms
    assert len(_gemms(fp8.backward, "fp8")) == 2 * gemms  # input and weight gradients
    kept = _gemms(fp8.forward, "bf16") + _gemms(fp8.backward, "bf16")
    llm = get_config(model).llm
    head = sorted((SEQ, llm.vocab // 2, llm.hidden))
    router = sorted((SEQ, llm.experts, llm.hidden))
    assert all(sorted(op.shape) in (head, router) for op in kept)
    assert sum(sorted(op.shape) == head for op in kept) == 3
    assert sum(sorted(op.shape) == router for op in kept) == 3 * sum(
        ".router." in t.name for t in get_model(model).tensors)
    # the same work: FLOPs of every GEMM and every attention op unchanged
    for phase in ("forward", "backward"):
        before = [op for op in getattr(bf16, phase) if isinstance(op, ComputeOp) and op.kind != "memory"]
        after = [op for op in getattr(fp8, phase) if isinstance(op, ComputeOp) and op.kind != "memory"]
        assert [op.flops for op in before] == [op.flops for op in after]
    # the FP8 weight copies (fp8 + its transpose) beside the bf16 weights
    assert fp8.memory.params - bf16.memory.params == 2 * weight_elements
    assert fp8.memory.grads == bf16.memory.grads and fp8.memory.optimizer == bf16.memory.optimizer


def test_inputs_kept_for_the_backward_shrink_by_one_byte_an_element() -> None:
    """tiny-gpt at tp=2, one micro-batch of SEQ tokens: each layer keeps four linear inputs
    (the attention input shared by q/k/v, o's input, the MLP input shared by gate/up, down's)."""
    traced, dims = _traced("tiny-gpt", "tp=2")
    fp8 = with_precision(traced, "fp8", dims).stages[0].memory
    bf16 = traced.stages[0].memory
    c = get_config("tiny-gpt").llm
    per_layer = SEQ * (c.hidden + c.heads * c.head_dim // 2 + c.hidden + c.ffn // 2)
    assert bf16.activations_per_microbatch - fp8.activations_per_microbatch == c.layers * per_layer
    assert fp8.activations_full == bf16.activations_full  # full recompute keeps only the layers' inputs


def test_the_casts_and_the_amax_reduction_by_scaling_recipe() -> None:
    traced, dims = _traced("tiny-gpt", "tp=2,dp=2")
    delayed = with_precision(traced, "fp8", dims, "delayed").stages[0]
    current = with_precision(traced, "fp8", dims, "current").stages[0]
    amax = [op for op in delayed.forward if getattr(op, "name", "") == AMAX]
    assert len(amax) == 1 and delayed.forward[-1] is amax[0]
    assert amax[0].group_size == 4  # tp x dp: the ranks whose amaxes must agree
    assert not any(getattr(op, "name", "") == AMAX for op in current.forward)
    for phase in ("forward", "backward"):
        d = [op for op in getattr(delayed, phase) if getattr(op, "name", "") == CAST]
        c = [op for op in getattr(current, phase) if getattr(op, "name", "") == CAST]
        assert d and [op.flops for op in d] == [op.flops for op in c]
        assert all(cop.bytes == dop.bytes * 6 / 4 for dop, cop in zip(d, c))  # the amax pass reads 2 bytes more
    # a backward cast of the output gradient, half before each of its two GEMMs: all of it once per linear
    gemms, _ = _linear_weights("tiny-gpt", tp=2)
    grads = sum(op.flops for op in delayed.backward if getattr(op, "name", "") == CAST)
    fwd = [op for op in delayed.forward if isinstance(op, ComputeOp) and op.dtype == "fp8" and op.kind == "matmul"]
    assert grads == sum(op.shape[0] * op.shape[1] for op in fwd)  # each forward output's gradient
    assert len(fwd) == gemms


def test_the_head_is_told_apart_when_a_micro_batch_has_as_many_tokens_as_the_vocabulary_shard() -> None:
    """vocab 512 at tp=2: a shard of 256 rows; a micro-batch of 256 tokens. The head's GEMMs and a
    linear layer's (width 96) share the token count; only the head's stay bf16."""
    hidden, tokens, width = 64, 256, 96
    linear = [ComputeOp("mm", "matmul", 1.0, 1.0, (tokens, width, hidden)),
              ComputeOp("mm", "matmul", 1.0, 1.0, (tokens, hidden, width)),
              ComputeOp("mm", "matmul", 1.0, 1.0, (width, hidden, tokens))]
    head = [ComputeOp("mm", "matmul", 1.0, 1.0, (tokens, 256, hidden)),
            ComputeOp("mm", "matmul", 1.0, 1.0, (tokens, hidden, 256)),
            ComputeOp("mm", "matmul", 1.0, 1.0, (256, hidden, tokens))]
    traced = Trace("t", tp=2, pp=1, dp=1, micro_batches=1, micro_batch_size=1, seq=tokens,
                   stages=[stage(0, forward=tuple(linear[:1] + head[:1]), backward=tuple(head[1:] + linear[1:]),
                                 memory=StageMemory(0, 0, 0, 10**6, 0))])
    dims = Dims(hidden, 512)
    assert [is_fp8_gemm(op, dims, traced) for op in linear] == [True] * 3
    assert [is_fp8_gemm(op, dims, traced) for op in head] == [False] * 3


def test_bf16_is_the_traced_program() -> None:
    traced, dims = _traced("tiny-gpt", "tp=2")
    assert with_precision(traced, "bf16", dims) is traced


def _llama8b(precision: str, gpu: str = "h100") -> dict:
    return emulate(EmulateRequest(model="llama3-8b", layout="tp=1,dp=8,zero=1", gpus=8, gpu=gpu, global_batch=8,
                                  micro_batch=1, seq=8192, recompute="selective", precision=precision))


def test_fp8_speeds_up_a_large_model_by_less_than_its_gemms_could() -> None:
    """Llama 3 8B: FP8 GEMMs run at 2x bf16's peak; the step gains less than the GEMMs'
    share (the casts, attention and the rest keep their time), and the result names it."""
    bf16, fp8 = _llama8b("bf16"), _llama8b("fp8")
    assert fp8["precision"] == "fp8" and fp8["fp8_scaling"] == "delayed" and "precision" not in bf16
    assert fp8["step_seconds"] < bf16["step_seconds"]
    compute = bf16["breakdown"]["compute"]
    assert fp8["breakdown"]["compute"] > compute / 2
    # FP8 weight copies: 2 bytes for each of the ~7B linear-layer parameters (not the embedding or head)
    c = get_config("llama3-8b").llm
    linear = c.layers * (c.hidden * c.head_dim * (c.heads * 2 + c.kv_heads * 2) + 3 * c.hidden * c.ffn)
    assert fp8["memory"]["per_stage"][0]["params"] - bf16["memory"]["per_stage"][0]["params"] == 2 * linear


def test_fp8_on_a_device_without_fp8_is_refused_naming_the_device() -> None:
    assert "fp8" not in get_profile("a100").peak_flops
    with pytest.raises(EmulatorError, match=r"--precision fp8: device a100 has no FP8 rate"):
        _llama8b("fp8", gpu="a100")
    with pytest.raises(EmulatorError, match=r"--precision 'fp4' not in"):
        _llama8b("fp4")


def test_emulate_help_lists_the_precisions_and_scalings(capsys) -> None:
    from dynaplane.cli import main

    with pytest.raises(SystemExit) as done:
        main(["emulate", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "--precision {bf16,fp8}" in out and "--fp8-scaling {delayed,current}" in out


def test_fused_casts_leave_the_attention_outputs_and_cast_weights_once_a_step() -> None:
    """Transformer Engine under Megatron-Core: norms and the activation write FP8 for the GEMMs
    after them, a weight is cast on the step's first micro-batch only; the o projection's input
    (attention's output) is still cast, and so is every output gradient in the backward."""
    traced, dims = _traced("tiny-gpt", "tp=2")
    separate = with_precision(traced, "fp8", dims, casts="separate").stages[0]
    fused = with_precision(traced, "fp8", dims, casts="fused").stages[0]
    c = get_config("tiny-gpt").llm
    casts = lambda ops: [op for op in ops if getattr(op, "name", "") == CAST]  # noqa: E731
    # forward: one cast a layer left, of the attention output (SEQ x q/tp elements)
    assert [op.flops for op in casts(fused.forward)] == [SEQ * c.heads * c.head_dim / 2] * c.layers
    gemms, weight_elements = _linear_weights("tiny-gpt", tp=2)
    assert sorted(op.flops for op in casts(fused.optimizer)) == sorted(
        op.shape[1] * op.shape[2] for op in fused.forward if getattr(op, "dtype", "") == "fp8" and op.kind == "matmul")
    assert sum(op.flops for op in casts(fused.optimizer)) == weight_elements and len(casts(fused.optimizer)) == gemms
    assert casts(fused.backward) == casts(separate.backward)
    assert fused.memory == separate.memory  # the same tensors kept; only where the casts run moves
    with pytest.raises(EmulatorError, match=r"fp8 casts='tiled' not in \('separate', 'fused'\)"):
        with_precision(traced, "fp8", dims, casts="tiled")
