"""The program a run used as a setting (stacks.py) and Transformer Engine's fused element-wise
kernels (elementwise.py): what the edit drops and adds, against the layer's bytes counted by
hand, and the stack's defaults against options a request sets itself."""
from __future__ import annotations

import pytest

from parallelism.emulator.elementwise import FUSED_LAYER, FUSED_NORM, KEPT, LayerShape, with_elementwise
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.stacks import STACKS, stack_defaults
from parallelism.emulator.trace import CommOp, ComputeOp
from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.layout.catalog import get_config

pytestmark = pytest.mark.timeout(300)

SEQ = 32


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _kept(ops) -> list:
    """What the fused edit must leave alone, in order: GEMMs, attention, collectives, the kept kernels."""
    return [op for op in ops if not (isinstance(op, ComputeOp) and op.kind == "memory"
                                     and not op.role and op.name not in KEPT)]


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_fused_layers_replace_the_element_wise_kernels_with_the_layers_bytes(sequence_parallel: bool) -> None:
    traced, _ = trace(TraceRequest("tiny-gpt", "tp=2,pp=2", 1, SEQ, 2, 8, sequence_parallel))
    c = get_config("tiny-gpt").llm
    fused = with_elementwise(traced, "fused", LayerShape.of(c), sequence_parallel)
    tokens, stream = SEQ, SEQ // 2 if sequence_parallel else SEQ
    h, q, kv, f = c.hidden, c.heads * c.head_dim / 2, c.kv_heads * c.head_dim / 2, c.ffn / 2
    # by hand, bf16: norms 2 x 4th, RoPE 4T(q+kv), residual adds 2 x 6th, SwiGLU 6Tf; backward 2 x 6th,
    # 4T(q+kv), 2 x 6th, 10Tf
    forward = 2 * (2 * 2 * stream * h + 2 * tokens * (q + kv) + 2 * 3 * stream * h + 3 * tokens * f)
    backward = 2 * (2 * 3 * stream * h + 2 * tokens * (q + kv) + 2 * 3 * stream * h + 5 * tokens * f)
    for before, after in zip(traced.stages, fused.stages):
        layers = sum(isinstance(op, ComputeOp) and op.kind == "attention" for op in before.forward)
        assert layers == 2
        for phase, each in (("forward", forward), ("backward", backward)):
            ops = getattr(after, phase)
            layer_ops = [op for op in ops if getattr(op, "name", "") == FUSED_LAYER]
            assert [op.bytes for op in layer_ops] == [pytest.approx(each)] * layers
            assert [op for op in ops if getattr(op, "name", "") not in (FUSED_LAYER, FUSED_NORM)] == \
                _kept(getattr(before, phase))
        norms = [op for op in after.forward + after.backward if getattr(op, "name", "") == FUSED_NORM]
        assert len(norms) == (2 if before.stage == 1 else 0)  # the last stage's final norm, each way
        assert all(0 <= i <= len(after.backward) for i in after.grad_sync_after)
        assert any(isinstance(op, CommOp) for op in after.forward)  # tensor-parallel collectives kept


def test_moe_and_encoder_models_are_refused_by_name() -> None:
    traced, _ = trace(TraceRequest("tiny-moe", "tp=1", 1, SEQ, 1, 8, False))
    with pytest.raises(EmulatorError, match="--elementwise fused is modelled for dense decoders"):
        with_elementwise(traced, "fused", LayerShape.of(get_config("tiny-moe").llm))
    assert with_elementwise(traced, "program", LayerShape.of(get_config("tiny-moe").llm)) is traced


def test_a_stack_fills_the_options_left_at_their_defaults() -> None:
    base = EmulateRequest("tiny-gpt", "tp=2", 2, "h100", 4, 1, SEQ, stack="megatron-core")
    resolved = stack_defaults(base)
    for key, value in STACKS["megatron-core"].items():
        assert getattr(resolved, key) == value
    own = stack_defaults(EmulateRequest("tiny-gpt", "tp=2", 2, "h100", 4, 1, SEQ, stack="megatron-core",
                                        grad_sync="step"))
    assert own.grad_sync == "step" and own.elementwise == "fused"  # the request's own choice stays
    assert stack_defaults(EmulateRequest("tiny-gpt", "tp=2", 2, "h100", 4, 1, SEQ)).optimizer == "program"


def test_emulate_names_the_stack_and_refuses_an_unknown_one() -> None:
    result = emulate(EmulateRequest("tiny-gpt", "tp=2", 2, "h100", 4, 1, SEQ, stack="megatron-core"))
    assert result["stack"] == "megatron-core" and result["elementwise"] == "fused"
    assert result["optimizer"] == "megatron" and result["grad_accumulation"] == "fused"
    with pytest.raises(EmulatorError, match=r"--stack 'deepspeed' not in \('program', 'megatron-core'"):
        emulate(EmulateRequest("tiny-gpt", "tp=2", 2, "h100", 4, 1, SEQ, stack="deepspeed"))


def test_megatron_core_memory_is_its_saved_tensors_and_bf16_gradients() -> None:
    """Llama 3.1 8B as DGX Cloud's recipe ran it (8 H100, cp=2, dp=4, distributed optimizer):
    its log shows 44.3 GB allocated between steps (5.5 bytes a parameter) and a 70.8 GB peak
    (66.0 GiB); the model's parts, counted by hand, and the peak within 10% of the log's."""
    result = emulate(EmulateRequest("llama3-8b", "tp=1,pp=1,cp=2,dp=4,zero=1", 8, "h100", 128, 1, 8192,
                                    stack="megatron-core"))
    [row] = result["memory"]["per_stage"]
    c = get_config("llama3-8b").llm
    params = 8_030_261_248
    assert row["params"] == 2 * params and row["grads"] == 2 * params and row["optimizer"] == 12 * params // 8
    T = 4096  # the rank's tokens: seq 8192 over cp=2
    h, q, kv, f = c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim, c.ffn
    layer = 2 * 2 * T * h + 2 * 2 * T * h + 2 * T * (2 * q + 2 * kv) + 2 * T * 2 * f + 2 * T * f
    assert row["activations"] == c.layers * layer + 4 * T * h + 4 * T * c.vocab
    assert abs(result["memory"]["peak_bytes"] / 70_833_405_952 - 1) < 0.10
    assert result["memory"]["fits"]


def test_the_megatron_core_memory_model_is_refused_for_moe_by_name() -> None:
    with pytest.raises(EmulatorError, match="--memory-model megatron-core is modelled for dense decoder-only"):
        emulate(EmulateRequest("tiny-moe", "tp=1", 1, "h100", 2, 1, SEQ, memory_model="megatron-core"))


def test_compare_and_search_run_every_configuration_on_the_stack(capsys) -> None:
    import json

    from dynaplane.cli import main

    assert main(["compare", "--model", "tiny-gpt", "--gpus", "2", "--gpu", "h100", "--global-batch", "4", "--seq",
                 str(SEQ), "--layout", "tp=2", "--layout", "dp=2", "--stack", "megatron-core", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["layout"] for r in rows] == ["tp=2", "dp=2"] and all(r["stack"] == "megatron-core" for r in rows)
    assert main(["search", "--model", "tiny-gpt", "--gpus", "2", "--gpu", "h100", "--global-batch", "4", "--seq",
                 str(SEQ), "--precision", "fp8", "--top", "2", "--max-candidates", "4", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["top"] and all(r["precision"] == "fp8" for r in found["top"])
