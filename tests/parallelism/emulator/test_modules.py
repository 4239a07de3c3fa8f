"""Models with an input module (a multimodal model's encoder, issue 8) in the emulator: the
step of colocated and non-colocated layouts on synthetic traces (textbook cases computed by
hand), bad layouts, the search's candidate set, and one real tiny-vlm trace end to end."""
from __future__ import annotations

from dataclasses import replace

import pytest

from parallelism.emulator.costs import op_seconds
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.search_space import multimodal_candidates, static_bytes
from parallelism.emulator.search_space import SearchRequest
from parallelism.emulator.simulate import input_chunks, simulate
from parallelism.emulator.trace import CommOp, InputTrace, StageMemory, Trace
from parallelism.emulator.tracer import TraceRequest, trace as trace_model
from parallelism.layout.catalog import get_model
from tests.parallelism.emulator.helpers import PROFILE, stage, uniform_trace


def hetero(colocated: bool, enc_f: float, enc_b: float, llm: Trace, samples: int = 8, boundary=((), ()),
           enc_memory: StageMemory | None = None) -> Trace:
    """The LLM's pipeline trace with an encoder feeding it."""
    encoder = stage(0, enc_f, enc_b, memory=enc_memory or StageMemory(1000, 2000, 3000, 400, 50))
    return replace(llm, inputs=(InputTrace("encoder", encoder, tp=1, dp=2, zero=0, samples=samples, tokens=17,
                                           colocated=colocated, boundary_forward=boundary[0],
                                           boundary_backward=boundary[1]),))


def test_colocated_step_is_the_sum_of_the_module_phases() -> None:
    llm = uniform_trace(pp=2, m=4, forward=1.0, backward=2.0)  # 1F1B: (m + pp - 1)(f + b) = 15 s
    send = CommOp("boundary_send", "send", 1e9, 2, 1, "pp")
    recv = CommOp("boundary_recv", "recv", 5e8, 2, 1, "pp")
    trace = hetero(True, 3.0, 5.0, llm, boundary=(((send, send), (recv,)), ((send,),)))
    result = simulate(trace, PROFILE)
    s = op_seconds(send, PROFILE)
    assert simulate(llm, PROFILE).step_seconds == pytest.approx(15.0)
    # forward exchange: the sender's two sends (2 s) outlast the receiver's one recv
    assert result.phases["boundary_forward"] == pytest.approx(2 * s)
    assert result.step_seconds == pytest.approx(3.0 + 2 * s + 15.0 + s + 5.0)
    assert sum(result.breakdown.values()) == pytest.approx(result.step_seconds)
    assert result.chunks == 1


@pytest.mark.parametrize("colocated", [True, False])
def test_an_input_module_that_costs_nothing_leaves_the_pipeline_alone(colocated: bool) -> None:
    """A decoder-only model is the one-module case: an empty encoder (no ops, no bytes, no
    boundary) adds nothing to the step, its breakdown or the per-stage memory."""
    llm = uniform_trace(pp=2, m=4, forward=1.0, backward=2.0)
    plain = simulate(llm, PROFILE)
    result = simulate(hetero(colocated, (), (), llm, enc_memory=StageMemory(0, 0, 0, 0, 0)), PROFILE)
    assert result.step_seconds == pytest.approx(plain.step_seconds)
    assert result.breakdown == pytest.approx(plain.breakdown)
    assert [s.peak for s in result.per_stage] == [s.peak for s in plain.per_stage]
    assert result.peak_bytes == plain.peak_bytes
    assert (plain.phases, plain.chunks, plain.input_memory) == ({}, 1, {})


def test_one_trace_format_holds_the_input_modules() -> None:
    trace = hetero(False, 1.0, 2.0, uniform_trace(pp=2, m=4),
                   boundary=(((CommOp("boundary_send", "send", 1e6, 2, 1, "pp"),),), ()))
    assert Trace.from_json(trace.to_json()) == trace
    data = uniform_trace(pp=2, m=4).to_dict()
    del data["inputs"]  # a decoder-only trace written before the field existed
    assert Trace.from_dict(data) == uniform_trace(pp=2, m=4)


def test_colocated_memory_holds_both_modules() -> None:
    llm = uniform_trace(pp=2, m=4)
    trace = hetero(True, 1.0, 1.0, llm, enc_memory=StageMemory(1000, 2000, 3000, 400, 500))
    result = simulate(trace, PROFILE)
    plain = simulate(llm, PROFILE)
    for row, s in zip(result.per_stage, plain.per_stage):
        # stage s holds min(pp - s, m) micro-batches of 100 B; temporary: the larger of 7 and 500
        assert row.peak == s.params + s.grads + s.optimizer + s.activations + 1000 + 2000 + 3000 + 400 + 500
    assert result.peak_bytes == max(r.peak for r in result.per_stage)


def test_non_colocated_step_is_the_critical_path_of_the_two_modules() -> None:
    # LLM pp=1, m=4, F=1, B=2; the encoder streams 4 chunks of F=1, B=2 each.
    # Encoder forwards end at 1, 2, 3, 4. LLM: F0 1-2 B0 2-4 F1 4-5 B1 5-7 F2 7-8 B2 8-10 F3 10-11 B3 11-13.
    # Encoder backwards (after its last forward, each when its gradient is back): 4-6, 7-9, 10-12, 13-15.
    llm = uniform_trace(pp=1, m=4, forward=1.0, backward=2.0)
    trace = hetero(False, 4.0, 8.0, llm)
    result = simulate(trace, PROFILE)
    assert result.chunks == 4
    assert result.phases["llm_step"] == pytest.approx(13.0)
    assert result.phases["encoder_end"] == pytest.approx(15.0)
    assert result.step_seconds == pytest.approx(15.0)
    assert result.critical_module == "encoder"
    assert sum(result.breakdown.values()) == pytest.approx(15.0)
    # The trainer's schedule today (one piece): forward 0-4, LLM 4-16, encoder backward 16-24.
    assert simulate(trace, PROFILE, chunks=1).step_seconds == pytest.approx(24.0)
    # A fast encoder hides behind the LLM: the LLM waits only for the first chunk (0.1 s), the encoder adds
    # only its last chunk's backward (0.2 s) after the LLM's last backward.
    fast = simulate(hetero(False, 0.4, 0.8, llm), PROFILE)
    assert fast.phases["llm_step"] == pytest.approx(0.1 + 12.0)
    assert fast.step_seconds == pytest.approx(0.1 + 12.0 + 0.2)


def test_non_colocated_memory_is_per_module() -> None:
    llm = uniform_trace(pp=2, m=4)
    trace = hetero(False, 1.0, 1.0, llm, enc_memory=StageMemory(10**6, 0, 0, 10, 0))
    result = simulate(trace, PROFILE)
    assert result.input_memory["encoder"]["peak"] == 10**6 + 10
    assert [r.peak for r in result.per_stage] == [s.peak for s in simulate(llm, PROFILE).per_stage]
    assert result.peak_bytes == 10**6 + 10


def test_encoder_chunks_divide_micro_batches_and_the_share() -> None:
    assert input_chunks(8, 4, colocated=False) == 4
    assert input_chunks(6, 4, colocated=False) == 2
    assert input_chunks(5, 4, colocated=False) == 1
    assert input_chunks(8, 4, colocated=True) == 1
    with pytest.raises(EmulatorError, match="chunks=3"):
        simulate(hetero(False, 1.0, 1.0, uniform_trace(pp=1, m=4)), PROFILE, chunks=3)


@pytest.mark.parametrize(("layout", "gpus", "message"), [
    ("encoder:dp=2,ranks=0-1;llm:tp=2,ranks=1-2", 3, "overlap"),
    ("encoder:dp=2,ranks=0-1;llm:tp=2,ranks=4-5", 6, "belong to no module"),
    ("encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3", 8, "--gpus is 8"),
    ("llm:tp=2,dp=2", 4, "has modules"),
    ("encoder:dp=4;llm:tp=2", 4, "same number of ranks"),
    ("encoder:pp=2,dp=2;llm:tp=2,dp=2", 4, "pp=2"),
    ("encoder:dp=2,cp=2;llm:tp=2,dp=2", 4, "encoder: cp=2"),
])
def test_bad_hetero_layouts_are_refused_with_the_reason(layout: str, gpus: int, message: str) -> None:
    with pytest.raises(EmulatorError, match=message):
        emulate(EmulateRequest("tiny-vlm", layout, gpus, "h100", 8, 1, 16))


def test_search_candidates_cover_the_three_placements_and_are_bounded() -> None:
    request = SearchRequest("tiny-vlm", gpus=4, gpu="h100", global_batch=8, seq=16)
    candidates = multimodal_candidates(request)
    kinds = {k for k, _, _ in candidates}
    assert kinds == {"homogeneous", "colocated", "non-colocated"}
    for kind, layout, _ in candidates:
        assert "zero=3" not in layout
        if kind == "homogeneous":
            assert ";" not in layout and "pp=1," in layout
        if kind == "non-colocated":
            assert "ranks=0-0;" in layout  # N/4 = 1 encoder GPU (N/8 and smaller are < 1)
    # bounded: per LLM layout at most 1 homogeneous + 2 colocated, plus 1 share x LLM layouts of 3 GPUs
    assert len(candidates) < 60


def test_a_traced_rank_with_empty_zero_chunks_traces() -> None:
    """LLM stage 1's first rank (rank 2) is encoder dp rank 2, whose ZeRO chunk of the 1-row
    class token is empty: HeteroTrainer builds it (it raised KeyError before)."""
    request = TraceRequest("tiny-vlm", "encoder:dp=4,zero=1;llm:tp=2,pp=2", micro_batch=2, seq=16, micro_batches=4)
    trace, info = trace_model(request, use_cache=False)
    (encoder,) = trace.inputs
    assert (encoder.colocated, encoder.dp, encoder.zero, len(trace.stages)) == (True, 4, 1, 2)
    assert info["stages_traced"] == 3  # the encoder class and both LLM stages


def test_static_bytes_of_a_colocated_rank_hold_both_modules() -> None:
    model = get_model("tiny-vlm")
    enc = sum(t.numel for t in model.tensors if t.split.module == "encoder")
    llm = sum(t.numel for t in model.tensors if t.split.module == "llm")
    assert static_bytes(model, "encoder:dp=2,ranks=0-1;llm:dp=2,ranks=2-3") == 18 * max(enc, llm)
    assert static_bytes(model, "dp=4") == 18 * (enc + llm)  # zero=0: 2 + 4 + 12 B per element


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """One real tiny-vlm trace (HeteroTrainer on fake tensors), non-colocated."""
    request = TraceRequest("tiny-vlm", "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3", micro_batch=2, seq=16,
                           micro_batches=4)
    trace, info = trace_model(request, use_cache=False)
    return trace, info


def test_tiny_vlm_trace_end_to_end(traced) -> None:
    trace, info = traced
    model = get_model("tiny-vlm")
    assert info["stages_traced"] == 2  # the encoder class and the one LLM stage, each in its own process
    (encoder,) = trace.inputs
    assert (encoder.colocated, encoder.dp, encoder.samples, encoder.tokens) == (False, 2, 4, 17)
    # traced static memory = the analytic per-module count: encoder tp=1, zero=0: 2 + 4 + 12 B per element;
    # LLM tp=2: tensors with a tp dim are halved
    enc = sum(t.numel for t in model.tensors if t.split.module == "encoder")
    llm = sum(t.numel // (2 if t.split.tp_dim is not None else 1) for t in model.tensors if t.split.module == "llm")
    assert (encoder.stage.memory.params, encoder.stage.memory.grads, encoder.stage.memory.optimizer) == (
        2 * enc, 4 * enc, 12 * enc)
    m = trace.stages[0].memory
    assert (m.params, m.grads, m.optimizer) == (2 * llm, 4 * llm, 12 * llm)
    # the boundary (the tracer checked the communicator's recorded messages against these): each encoder rank
    # sends its 4 samples x 17 tokens x 64 hidden (bf16) to both LLM tp ranks; one of them returns its gradient
    box = 4 * 17 * 64 * 2
    forward = sorted((op.kind, op.bytes) for ops in encoder.boundary_forward for op in ops)
    assert forward == [("recv", box)] * 4 + [("send", box)] * 4
    assert [len(ops) for ops in encoder.boundary_forward] == [2, 2, 2, 2]
    backward = sorted((op.kind, op.bytes) for ops in encoder.boundary_backward for op in ops)
    assert backward == [("recv", box)] * 2 + [("send", box)] * 2
    # the encoder's dp gradient all-reduce, the LLM's tp collectives inline
    assert [op.kind for op in encoder.stage.grad_sync] == ["all_reduce"]
    assert any(isinstance(op, CommOp) and op.dim == "tp" for op in trace.stages[0].forward)
    # the LLM sees image tokens + text
    assert trace.seq == 17 + 16
    result = simulate(trace, replace(PROFILE))
    assert result.step_seconds >= max(result.phases["llm_step"], result.phases["encoder_end"]) - 1e-12
    assert Trace.from_json(trace.to_json()) == trace


def test_the_llm_sequence_parallelism_of_a_multimodal_model_traces() -> None:
    """HeteroTrainer's SP (the LLM only): the LLM stages' TP collectives become reduce-scatter
    + all-gather on the (image + text)/tp slice, the p2p sends between LLM stages halve, the
    kept activations shrink; the encoder's trace is SP's no concern. 17 image + 15 text = 32
    positions split over tp=2; 17 + 16 = 33 is refused, naming the rule."""
    layout = "encoder:dp=4;llm:tp=2,pp=2"
    plain, _ = trace_model(TraceRequest("tiny-vlm", layout, micro_batch=1, seq=15, micro_batches=4), use_cache=False)
    sp, _ = trace_model(TraceRequest("tiny-vlm", layout, micro_batch=1, seq=15, micro_batches=4,
                                     sequence_parallel=True), use_cache=False)
    assert sp.inputs[0].stage == plain.inputs[0].stage  # the encoder runs without SP
    assert sp.inputs[0].boundary_forward == plain.inputs[0].boundary_forward  # image tokens arrive replicated
    for a, b in zip(plain.stages, sp.stages):
        def tp_kinds(stage):
            return {op.kind for op in stage.forward + stage.backward if getattr(op, "dim", None) == "tp"}

        def sends(stage):
            return {op.name: op.bytes for op in stage.forward + stage.backward if getattr(op, "dim", None) == "pp"}

        assert {"reduce_scatter", "all_gather"} <= tp_kinds(b) and "reduce_scatter" not in tp_kinds(a)
        assert sends(a) and {name: 2 * size for name, size in sends(b).items()} == sends(a)
        assert sends(b)[next(iter(sends(b)))] == 1 * 16 * 64 * 2  # [1, 32/2, hidden 64] bf16
        assert b.memory.activations_per_microbatch < a.memory.activations_per_microbatch
        assert b.memory.activations_full * 2 == a.memory.activations_full
    with pytest.raises(EmulatorError, match="17 \\+ seq 16 = 33 is not a multiple of 2"):
        emulate(EmulateRequest("tiny-vlm", layout, 4, "h100", 4, 1, 16, sequence_parallel=True))
    result = emulate(EmulateRequest("tiny-vlm", layout, 4, "h100", 4, 1, 15, sequence_parallel=True),
                     use_cache=False)
    assert result["sequence_parallel"] and result["step_seconds"] > 0


def test_an_interleaved_llm_pipeline_of_a_multimodal_model_traces() -> None:
    """HeteroTrainer's vpp (the LLM's pp=2 x vpp=2 chunks of one layer each, chunk k on
    pipeline rank k % 2): four virtual stages, each traced on its rank running the trainer's
    own chunk k; a rank's chunks' static memory adds up to the vpp=1 stage's (same layers'
    sizes, the embedding on chunk 0, the head on chunk 3); every chunk but the last sends
    its activations on, every one but the first its gradients back, of the vpp=1 sends'
    size; the encoder and the boundary are vpp's no concern. A micro-batch count torch's
    interleaved schedule cannot run is refused, naming the rule."""
    layout = "encoder:dp=4;llm:tp=2,pp=2"
    plain, _ = trace_model(TraceRequest("tiny-vlm", layout, micro_batch=1, seq=16, micro_batches=4), use_cache=False)
    vpp, info = trace_model(TraceRequest("tiny-vlm", layout + ",vpp=2", micro_batch=1, seq=16, micro_batches=4),
                            use_cache=False)
    assert (vpp.pp, vpp.vpp, len(vpp.stages)) == (2, 2, 4)
    assert info["stages_traced"] == 1 + 3  # the encoder; the first, the last and the two middle chunks (one class)
    assert vpp.inputs == plain.inputs
    for rank in range(2):
        for key in ("params", "grads", "optimizer"):
            chunks = sum(getattr(vpp.stages[rank + 2 * c].memory, key) for c in range(2))
            assert chunks == getattr(plain.stages[rank].memory, key), (rank, key)

    def sends(stage):
        return {op.name: op.bytes for op in stage.forward + stage.backward if getattr(op, "dim", None) == "pp"}

    size = 1 * (17 + 16) * 64 * 2  # [1, image + text, hidden 64] bf16
    assert [sends(s) for s in vpp.stages] == [
        {"pp_send_activations": size}, {"pp_send_activations": size, "pp_send_gradients": size},
        {"pp_send_activations": size, "pp_send_gradients": size}, {"pp_send_gradients": size}]
    assert sends(plain.stages[0]) == {"pp_send_activations": size}
    assert simulate(vpp, PROFILE).step_seconds > 0
    with pytest.raises(EmulatorError, match="llm: vpp=2: .* micro-batches must be a multiple of 2"):
        emulate(EmulateRequest("tiny-vlm", layout + ",vpp=2", 4, "h100", 5, 1, 16))
    result = emulate(EmulateRequest("tiny-vlm", layout + ",vpp=2", 4, "h100", 4, 1, 16), use_cache=False)
    assert result["step_seconds"] > 0


def test_the_llm_context_parallelism_of_a_multimodal_model_traces() -> None:
    """HeteroTrainer's cp (the LLM only): each cp rank keeps its chunk of the 17 image + 15
    text = 32 positions, so the p2p sends between LLM stages halve against the same world's
    dp=2 layout; attention gathers K/V over cp (all-gather forward, reduce-scatter backward,
    told apart from dp's by group); the first stage sums the image tokens' gradient over cp;
    the state, replicated over dp x cp, is dp=2's; the encoder's trace and the boundary
    (each cp rank gets the image tokens whole) are cp's no concern. A sequence cp cannot
    split is refused, naming the rule."""
    base = TraceRequest("tiny-vlm", "encoder:dp=4;llm:dp=2,pp=2", micro_batch=1, seq=15, micro_batches=2)
    plain, _ = trace_model(base, use_cache=False)
    cp, _ = trace_model(replace(base, layout="encoder:dp=4;llm:cp=2,pp=2", micro_batches=4), use_cache=False)
    assert (cp.cp, cp.dp, cp.pp, cp.seq) == (2, 1, 2, 32)
    assert cp.inputs[0].stage.forward == plain.inputs[0].stage.forward
    # 4 images, one per encoder rank; both cp ranks of the LLM's first stage (ranks 0, 1) get all
    # 4 whole (17 tokens x 64 hidden bf16): one message from each of the other three ranks
    received = [sorted(op.bytes for op in ops if op.kind == "recv") for ops in cp.inputs[0].boundary_forward]
    assert received == [[17 * 64 * 2] * 3] * 2 + [[]] * 2, received

    def comm(stage, dim):
        return [(op.kind, op.name) for op in stage.forward + stage.backward if getattr(op, "dim", None) == dim]

    def sends(stage):
        return {op.name: op.bytes for op in stage.forward + stage.backward if getattr(op, "dim", None) == "pp"}

    for a, b in zip(plain.stages, cp.stages):
        kinds = {kind for kind, _ in comm(b, "cp")}
        assert {"all_gather", "reduce_scatter"} <= kinds and not comm(a, "cp")
        assert sends(b) and {name: 2 * size for name, size in sends(b).items()} == sends(a)
        assert (b.memory.params, b.memory.grads, b.memory.optimizer) == (
            a.memory.params, a.memory.grads, a.memory.optimizer)
    assert ("all_reduce" in {kind for kind, _ in comm(cp.stages[0], "cp")}
            and "all_reduce" not in {kind for kind, _ in comm(cp.stages[1], "cp")})  # the image tokens' gradient
    assert simulate(cp, PROFILE).step_seconds > 0
    with pytest.raises(EmulatorError, match="context parallelism .* 17 \\+ seq 16 = 33 is not a multiple of 2"):
        emulate(EmulateRequest("tiny-vlm", "encoder:dp=4;llm:cp=2,pp=2", 4, "h100", 4, 1, 16))


@pytest.mark.parametrize("layout", ["encoder:dp=4,zero=3;llm:tp=2,dp=2,zero=3",
                                    "encoder:dp=2,zero=3,ranks=0-1;llm:dp=2,zero=3,ranks=2-3"])
def test_zero3_modules_trace_fsdp(layout: str) -> None:
    """zero=3 (issue 29): each module's FSDP2 all-gathers its weights over its dp ranks (param
    sync) and reduce-scatters their gradients every micro-batch; its static memory is the fp32
    shard (4 B) for the parameter, the gradient and each Adam moment, about 1/dp of the whole."""
    request = TraceRequest("tiny-vlm", layout, micro_batch=2, seq=16, micro_batches=4)
    trace, _ = trace_model(request, use_cache=False)
    (encoder,) = trace.inputs
    model = get_model("tiny-vlm")
    enc = sum(t.numel for t in model.tensors if t.split.module == "encoder")
    for stage, dp, numel in [(encoder.stage, encoder.dp, enc)] + [(s, trace.dp, None) for s in trace.stages]:
        assert stage.grad_sync_each_microbatch
        assert stage.param_sync and {(op.kind, op.dim) for op in stage.param_sync} == {("all_gather", "dp")}
        assert stage.grad_sync and {(op.kind, op.dim) for op in stage.grad_sync} == {("reduce_scatter", "dp")}
        m = stage.memory
        assert m.grads == m.params and m.optimizer == 2 * m.params
        if numel is not None:  # FSDP2 pads a shard to the largest one: within a few rows of the even cut
            assert 4 * numel / dp <= m.params <= 1.02 * 4 * numel / dp, (m.params, numel, dp)
    result = emulate(EmulateRequest("tiny-vlm", layout, 4, "h100", 8, 1, 16), use_cache=False)
    assert result["step_seconds"] > 0


def test_zero3_with_an_interleaved_llm_pipeline_traces_each_chunks_shards() -> None:
    """zero=3 under vpp=2 (each chunk an FSDP root): a rank's chunks' static memory (fp32
    shards of their own parameters) adds up to its vpp=1 stage's, and every chunk all-gathers
    and reduce-scatters its weights over dp."""
    layout = "encoder:dp=4,zero=3;llm:dp=2,pp=2,zero=3"
    plain, _ = trace_model(TraceRequest("tiny-vlm", layout, micro_batch=1, seq=16, micro_batches=4), use_cache=False)
    vpp, _ = trace_model(TraceRequest("tiny-vlm", layout + ",vpp=2", micro_batch=1, seq=16, micro_batches=4),
                         use_cache=False)
    assert (vpp.pp, vpp.vpp, len(vpp.stages)) == (2, 2, 4)
    for rank in range(2):
        for key in ("params", "grads", "optimizer"):
            chunks = sum(getattr(vpp.stages[rank + 2 * c].memory, key) for c in range(2))
            assert chunks == getattr(plain.stages[rank].memory, key), (rank, key)
    for stage in vpp.stages:
        assert {(op.kind, op.dim) for op in stage.param_sync} == {("all_gather", "dp")}
        assert {(op.kind, op.dim) for op in stage.grad_sync} == {("reduce_scatter", "dp")}
        assert stage.memory.grads == stage.memory.params > 0


def test_a_tied_llm_embedding_traces_its_end_stage_sum() -> None:
    """tiny-vlm-tied over llm tp=2, pp=2 (issue 29): both end stages all-reduce their copy's
    gradient over the pair ("embed": vocab/tp x hidden, fp32), at the optimizer step; the
    untied tiny-vlm has no such op."""
    layout = "encoder:dp=4;llm:tp=2,pp=2"
    tied, _ = trace_model(TraceRequest("tiny-vlm-tied", layout, micro_batch=2, seq=16, micro_batches=4),
                          use_cache=False)
    untied, _ = trace_model(TraceRequest("tiny-vlm", layout, micro_batch=2, seq=16, micro_batches=4), use_cache=False)
    vocab, hidden = 512, 64
    for stage in tied.stages:
        embed = [op for op in stage.optimizer if getattr(op, "dim", None) == "embed"]
        assert [(op.kind, op.bytes, op.group_size) for op in embed] == [("all_reduce", vocab // 2 * hidden * 4, 2)]
    assert not any(getattr(op, "dim", None) == "embed" for s in untied.stages for op in s.optimizer)
    result = emulate(EmulateRequest("tiny-vlm-tied", layout, 4, "h100", 8, 1, 16), use_cache=False)
    assert result["step_seconds"] > 0
