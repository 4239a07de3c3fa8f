"""A run that differs from the traced program (issue 30): unfused attention, fused gradient
accumulation, when gradients are reduced. Each edit of the trace is checked against what it
must mean: kernels and bytes by formula, positions kept, step times against oracles."""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.emulator.attention_kernels import (CORE_ATTENTION_FORWARD, SCORE_KERNELS, kept_bytes,
                                                    unfused_backward, unfused_forward, with_attention)
from parallelism.emulator.costs import op_seconds
from parallelism.emulator.devices import FLASH_PAPER_STANDARD_ATTENTION, get_profile
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.grad_accumulation import first_backward, with_grad_accumulation
from parallelism.emulator.grad_sync import BUCKET_BYTES, buckets_of, with_grad_sync
from parallelism.emulator.hidden_dropout import with_hidden_dropout
from parallelism.emulator.network import collective_seconds
from parallelism.emulator.optimizer_step import megatron_step, with_optimizer
from parallelism.emulator.pipeline_p2p import with_pipeline_p2p
from parallelism.emulator.simulate import simulate
from parallelism.emulator.stage_cost import RECEIVED_GATHER, is_p2p, recomputed_ops
from parallelism.emulator.trace import CommOp, ComputeOp, StageMemory
from parallelism.emulator.tracer import TraceRequest, trace

from .helpers import PROFILE, stage, timed, uniform_trace, with_stages

pytestmark = [pytest.mark.timeout(300)]
MS = 1e-3
SHAPE = (2, 4, 64, 64, 16)  # batch, heads, seq_q, seq_kv, head_dim


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _attention(direction: str = "") -> ComputeOp:
    b, a, sq, skv, d = SHAPE
    return ComputeOp(f"_scaled_dot_product_flash_attention{direction}", "attention", 2.0 * b * a * sq * skv * d, 1e6,
                     SHAPE)


# --- attention kernels ----------------------------------------------------------------------------

@given(b=st.integers(1, 8), a=st.integers(1, 32), sq=st.integers(1, 4096), skv=st.integers(1, 4096),
       d=st.sampled_from([32, 64, 96, 128, 160]), dropout=st.sampled_from([0.0, 0.1]))
@settings(max_examples=60, deadline=None)
def test_unfused_kernels_compute_the_whole_square_and_move_the_scores_through_memory(b, a, sq, skv, d, dropout):
    n = b * a * sq * skv
    forward, backward = unfused_forward((b, a, sq, skv, d), "bf16", dropout), unfused_backward((b, a, sq, skv, d),
                                                                                              "bf16", dropout)
    gemm = lambda ops: sum(op.flops for op in ops if op.kind == "matmul")  # noqa: E731
    assert gemm(forward) == 2 * 2 * n * d and gemm(backward) == 4 * 2 * n * d  # Q K^T, P V; their 4 gradients
    assert all(op.shape[0] == b * a for op in forward + backward if op.kind == "matmul")
    square = lambda ops: sum(op.bytes for op in ops if op.kind == "memory")  # noqa: E731
    # softmax reads and writes the scores (2+2 bytes); dropout reads them, writes them and a 1-byte mask
    assert square(forward) == n * (4 + (5 if dropout else 0))
    assert square(backward) == n * (6 + (5 if dropout else 0))
    assert kept_bytes((b, a, sq, skv, d), "bf16", dropout) == n * (2 + (3 if dropout else 0))
    assert [op.name for op in forward] == [x for x in CORE_ATTENTION_FORWARD if dropout or "dropout" not in x]


def test_unfused_attention_replaces_each_fused_op_and_keeps_every_position():
    fwd = (timed("f0", MS), _attention(), timed("f2", MS))
    bwd = (timed("b0", MS), _attention("_backward"), timed("b2", MS), timed("b3", MS))
    gather = CommOp("g", "all_gather", 1e6, 2, 1, "dp")
    s = stage(0, forward=fwd, backward=bwd, grad_sync=(CommOp("r", "reduce_scatter", 1e6, 2, 1, "dp"),),
              grad_sync_after=(3,), param_sync=(gather, gather), param_sync_phase=("forward", "backward"),
              param_sync_at=(2, 3), memory=StageMemory(10, 20, 30, 100, 7))
    out = with_attention(with_stages(uniform_trace(1, 2), [s]), "unfused", 0.1).stages[0]
    assert [op.name for op in out.forward] == ["f0", *CORE_ATTENTION_FORWARD, "f2"]
    assert len(out.backward) == 3 + 6  # b0, b2, b3 and the six backward kernels
    # the ops at the remapped positions are the ones that were there
    assert out.forward[out.param_sync_at[0]].name == "f2"
    assert out.backward[out.param_sync_at[1]].name == "b3"
    assert out.backward[out.grad_sync_after[0] - 1].name == "b2"
    kept = kept_bytes(SHAPE, "bf16", 0.1)
    assert out.memory.activations_per_microbatch == 100 + kept
    assert out.memory.activations_selective == 100  # selective recompute drops exactly the s x s tensors
    assert with_attention(with_stages(uniform_trace(1, 2), [s]), "flash").stages[0] is s


def test_selective_recompute_reruns_the_core_attention_kernels():
    s = stage(0, forward=(timed("f0", MS), _attention(), timed("f2", MS)), backward=1.0)
    out = with_attention(with_stages(uniform_trace(1, 1), [s]), "unfused", 0.1).stages[0]
    assert [op.name for op in recomputed_ops(out, "selective")] == list(CORE_ATTENTION_FORWARD)
    assert len(recomputed_ops(out, "full")) == len(out.forward)


def test_unfused_kernels_cost_the_roofline_of_each_kernel():
    forward = unfused_forward(SHAPE, "bf16", 0.1)
    out = with_attention(with_stages(uniform_trace(1, 1), [stage(0, forward=(_attention(),), backward=1.0)]),
                         "unfused", 0.1)
    one = simulate(out, PROFILE).per_stage[0]
    assert one.breakdown["compute"] == pytest.approx(sum(op_seconds(op, PROFILE) for op in forward) + 1.0)


def test_every_unfused_kernel_is_named_as_moving_the_scores():
    shape = (2, 4, 64, 64, 16)
    names = {op.name for op in unfused_forward(shape, "bf16", 0.1) + unfused_backward(shape, "bf16", 0.1)}
    assert names == set(SCORE_KERNELS)


def test_our_kernel_bytes_match_the_measured_standard_attention():
    """Dao et al. 2022 measured 40.3 GB of HBM traffic for standard attention (GPT-2 medium: batch
    64, 16 heads, seq 1024, head dim 64, causal mask and dropout, forward + backward). Megatron's
    kernels fuse the mask into the softmax; PyTorch's standard attention masks in a kernel of its
    own (read + write the scores forward, the same backward): with it, ours must land near 40.3 GB."""
    shape = (64, 16, 1024, 1024, 64)
    n = 64 * 16 * 1024 * 1024
    ops = unfused_forward(shape, "fp16", 0.1) + unfused_backward(shape, "fp16", 0.1)
    # the GEMMs' s x s traffic: what is not their q, k, v or output operands
    square = sum(op.bytes for op in ops if op.kind == "memory") + sum(
        op.bytes - 2 * (64 * 16 * 1024 * 64 * 2) for op in ops if op.kind == "matmul")
    mask = 2 * (2 * n * 2)
    assert (square + mask) / FLASH_PAPER_STANDARD_ATTENTION["hbm_bytes"] == pytest.approx(1.0, abs=0.08)


def test_a100_runs_the_score_kernels_at_the_measured_fraction_of_its_bandwidth():
    a100, h100 = get_profile("a100"), get_profile("h100")
    measured = 40.3e9 / 41.7e-3 / 1.555e12
    for op in unfused_forward(SHAPE, "bf16", 0.1) + unfused_backward((64, 16, 2048, 2048, 64), "bf16", 0.1):
        assert a100.op_memory_bandwidth(op.name) == pytest.approx(a100.hbm_bandwidth * measured)
        assert h100.op_memory_bandwidth(op.name) == h100.memory_bandwidth  # no measurement: the generic figure
    # the memory roof of a GEMM reading the s x s probabilities is that rate too
    bmm = unfused_backward((64, 16, 2048, 2048, 64), "bf16", 0.0)[0]
    assert op_seconds(bmm, a100) >= bmm.bytes / (a100.hbm_bandwidth * measured)
    plain = replace(bmm, name="bmm")
    assert op_seconds(plain, a100) < op_seconds(bmm, a100)


# --- the optimizer step ---------------------------------------------------------------------------

@given(stepped=st.integers(0, 10**10), held=st.integers(0, 10**10), fp32=st.booleans())
@settings(max_examples=50, deadline=None)
def test_megatron_step_moves_its_kernels_bytes_per_parameter(stepped, held, fp32):
    kernels = megatron_step(stepped, held, fp32)
    assert all(op.kind == "memory" for op in kernels)
    # unscale 8, norm 4, fused Adam 28, main -> model params 6; then zero the fp32 buffer (4) or copy half grads (6)
    assert sum(op.bytes for op in kernels) == 46 * stepped + (4 if fp32 else 6) * held


def test_megatron_optimizer_replaces_the_programs_step_and_keeps_its_collectives():
    traced, _ = trace(TraceRequest("tiny-gpt", "tp=2,pp=1,dp=1,zero=1", 2, 16, 4))
    s = traced.stages[0]
    norm = CommOp("grad_norm", "all_reduce", 4, 2, 2, "tp")
    traced = with_stages(traced, [replace(s, optimizer=s.optimizer + (norm,))])
    out = with_optimizer(traced, "megatron", fp32_grads=True).stages[0]
    stepped, held = s.memory.optimizer // 12, s.memory.grads // 4
    assert stepped == held > 0  # no ZeRO: the rank steps every parameter it holds
    assert [op for op in out.optimizer if isinstance(op, CommOp)] == [norm]
    assert sum(op.bytes for op in out.optimizer if isinstance(op, ComputeOp)) == 50 * stepped
    # the program's own step: torch's fused AdamW (32 bytes a parameter as its schema counts,
    # plus a 4-byte step counter per tensor; one call per parameter group, with and without
    # weight decay) between the gradients' concatenation and clone and the bf16 cast; no
    # foreach passes (no square root into a temporary list)
    fused = [op.bytes for op in s.optimizer if isinstance(op, ComputeOp) and op.name == "_fused_adamw_"]
    assert len(fused) == 2 and 0 < sum(fused) - 32 * stepped < 4 * 1000
    assert not [op for op in s.optimizer if isinstance(op, ComputeOp) and "sqrt" in op.name]
    program = sum(op.bytes for op in s.optimizer if isinstance(op, ComputeOp))
    assert 50 * stepped < program < 60 * stepped
    assert out.forward == s.forward and out.backward == s.backward and out.memory == s.memory
    assert with_optimizer(traced, "program") is traced
    with pytest.raises(EmulatorError, match="optimizer="):
        with_optimizer(traced, "lamb")


# --- gradient reduction ---------------------------------------------------------------------------

def _bucket(seconds: float) -> CommOp:
    latency = 2 * 7 * PROFILE.inter_node_latency
    return CommOp("g", "all_reduce", (seconds - latency) * PROFILE.inter_bw * 8 / (2 * 7), 8, 8, "dp")


def test_buckets_hold_at_most_the_cap_and_all_the_bytes():
    op = CommOp("g", "all_reduce", 3.5 * BUCKET_BYTES, 8, 8, "dp")
    pieces = buckets_of(op)
    assert len(pieces) == 4 and all(p.bytes <= BUCKET_BYTES for p in pieces)
    assert sum(p.bytes for p in pieces) == pytest.approx(op.bytes)
    assert buckets_of(replace(op, bytes=10.0)) == (replace(op, bytes=10.0),)


def test_program_reduction_of_interleaved_chunks_waits_for_every_chunks_backward():
    """vpp=2, one rank: chunk 1's backward ends before chunk 0's; the program reduces both in
    its optimizer step, so nothing of either bucket hides behind a backward."""
    bucket = _bucket(5 * MS)
    t = collective_seconds(bucket, PROFILE)
    stages = [stage(k, forward=MS, backward=tuple(timed(f"b{i}", MS) for i in range(4)), grad_sync=(bucket,),
                    grad_sync_after=(4,), grad_sync_in_step=True) for k in range(4)]
    trace = with_stages(uniform_trace(2, 2, vpp=2), stages)
    stepped = simulate(trace, PROFILE)
    overlapped = simulate(with_stages(trace, [replace(s, grad_sync_in_step=False) for s in trace.stages]), PROFILE)
    rank = stepped.per_stage[0]
    assert rank.breakdown["dp_comm"] == pytest.approx(2 * t, rel=1e-9)  # both buckets, after the last backward
    assert stepped.step_seconds > overlapped.step_seconds


def test_overlapped_reduction_hides_behind_the_last_backward_and_step_reduction_does_not():
    buckets = (_bucket(2 * MS),)
    backward = tuple(timed(f"b{i}", 1 * MS) for i in range(10))
    s = stage(0, forward=MS, backward=backward, grad_sync=buckets, grad_sync_after=(10,))
    trace = with_stages(uniform_trace(1, 2), [s])
    t = collective_seconds(buckets[0], PROFILE)
    stepped = simulate(with_grad_sync(trace, "step"), PROFILE)
    assert stepped.breakdown["dp_comm"] == pytest.approx(t, rel=1e-9)
    over = with_grad_sync(replace(trace, stages=(replace(s, grad_sync=(replace(buckets[0], bytes=60 * 2**20),)),)),
                          "overlapped")
    pieces = over.stages[0].grad_sync
    assert len(pieces) == 3 and over.stages[0].grad_sync_after == (3, 7, 10)
    assert simulate(over, PROFILE).breakdown["dp_comm"] < sum(collective_seconds(p, PROFILE) for p in pieces)
    assert with_grad_sync(trace, "program") is trace


# --- the traced program ---------------------------------------------------------------------------

def test_the_tracer_tags_each_gradient_accumulation_and_fusing_drops_exactly_their_time():
    traced, _ = trace(TraceRequest("tiny-gpt", "tp=1,pp=1,dp=1,zero=1", 2, 16, 4))
    s = traced.stages[0]
    tagged = [op for op in s.backward if isinstance(op, ComputeOp) and op.role == "grad_accumulate"]
    params = s.memory.grads // 4  # the fp32 buffers: one element a parameter
    # a steady-state micro-batch: fp32 += bf16 in place, 4 + 2 read, 4 written
    assert tagged and all(op.name == "add_" and op.dtype == "fp32" for op in tagged)
    assert sum(op.bytes for op in tagged) == 10 * params
    fused = with_grad_accumulation(traced, "fused")
    assert not any(getattr(op, "role", "") for op in fused.stages[0].backward)
    cpu = replace(PROFILE, launch_seconds=2e-6)
    drop = simulate(traced, cpu).step_seconds - simulate(fused, cpu).step_seconds
    # micro-batches 2-4 add into the buffers; the first makes them (a cast, 6 bytes a parameter)
    casts = [op for op in first_backward(s.backward) if isinstance(op, ComputeOp) and op.role == "grad_accumulate"]
    assert [op.name for op in casts] == ["_to_copy"] * len(tagged) and sum(op.bytes for op in casts) == 6 * params
    assert drop == pytest.approx(3 * sum(op_seconds(op, cpu) for op in tagged) + sum(op_seconds(op, cpu) for op in casts),
                                 rel=1e-9)


def test_a_step_of_one_micro_batch_traces_its_casts_and_prices_them_as_traced():
    traced, _ = trace(TraceRequest("tiny-gpt", "tp=1,pp=1,dp=1,zero=1", 2, 16, 1))
    backward = traced.stages[0].backward
    tagged = [op for op in backward if isinstance(op, ComputeOp) and op.role == "grad_accumulate"]
    assert tagged and all(op.name == "_to_copy" for op in tagged)
    assert first_backward(backward) == backward


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add_", "_to_copy", "mm", "mul"]), st.sampled_from(["", "grad_accumulate"]),
                          st.floats(0, 1e9)), max_size=12))
def test_the_first_backward_swaps_only_the_tagged_adds_for_casts_in_place(ops):
    backward = tuple(ComputeOp(name, "memory", 0.0, nbytes, (), "fp32", role=role, source="bf16")
                     for name, role, nbytes in ops)
    first = first_backward(backward)
    assert len(first) == len(backward)
    for before, after in zip(backward, first):
        if before.role == "grad_accumulate" and before.name == "add_":
            assert after == replace(before, name="_to_copy", bytes=before.bytes * 6 / 10)
        else:
            assert after is before


def test_each_stage_pays_the_cast_on_its_first_micro_batch_and_the_add_after():
    """Two stages, four micro-batches: in the 1F1B order each stage's backward of
    micro-batch 0 is its first, and only that one is cheaper (by the add's 4 bytes a
    parameter the cast does not move)."""
    add = ComputeOp("add_", "memory", 0.0, 10 * PROFILE.memory_bandwidth, (), "fp32", role="grad_accumulate",
                    source="bf16")
    traced = with_stages(uniform_trace(2, 4), [stage(i, 1.0, (timed("b", 2.0), add)) for i in range(2)])
    sim = simulate(traced, PROFILE, record_events=True)
    for rank in (0, 1):
        backwards = sorted((e for e in sim.events if e.rank == rank and e.kind == "backward"), key=lambda e: e.start)
        lengths = {e.micro_batch: e.end - e.start for e in backwards}
        assert lengths == pytest.approx({0: 2.0 + 6.0, 1: 12.0, 2: 12.0, 3: 12.0})


def test_tensor_parallel_backward_reduces_one_input_gradient_per_sublayer():
    """q, k, v take their input as one DTensor: one all-reduce for the attention block's input
    gradient and one for the MLP's, as Megatron's fused QKV projection (not one per projection)."""
    traced, _ = trace(TraceRequest("tiny-gpt", "tp=2,pp=1,dp=1,zero=1", 2, 16, 4))
    s = traced.stages[0]
    forward = [op for op in s.forward if isinstance(op, CommOp) and op.dim == "tp" and op.kind == "all_reduce"]
    backward = [op for op in s.backward if isinstance(op, CommOp) and op.dim == "tp" and op.kind == "all_reduce"]
    assert len(backward) == len(forward)  # forward: the row-parallel outputs; backward: the column-parallel inputs


def test_emulate_refuses_unknown_run_options_naming_the_flag():
    base = dict(model="tiny-gpt", layout="tp=1,pp=1,dp=2,zero=1", gpus=2, gpu="a100", global_batch=4, micro_batch=1,
                seq=16)
    for changes, flag in ((dict(attention="fast"), "--attention"), (dict(attention="unfused", attention_dropout=1.5),
                                                                    "--attention-dropout"),
                          (dict(attention_dropout=0.1), "--attention-dropout"), (dict(grad_sync="later"),
                                                                                 "--grad-sync"),
                          (dict(grad_accumulation="maybe"), "--grad-accumulation"),
                          (dict(pipeline_p2p="carrier-pigeon"), "--pipeline-p2p"),
                          (dict(hidden_dropout=-0.5), "--hidden-dropout"), (dict(optimizer="sgd"), "--optimizer"),
                          (dict(optimizer="megatron", layout="tp=1,pp=1,dp=2,zero=3"), "--optimizer megatron")):
        with pytest.raises(EmulatorError, match=flag):
            emulate(EmulateRequest(**{**base, **changes}))
    flash = emulate(EmulateRequest(**base))
    unfused = emulate(EmulateRequest(**base, attention="unfused", attention_dropout=0.1, grad_sync="overlapped",
                                     grad_accumulation="fused"))
    assert unfused["attention"] == "unfused" and unfused["grad_sync"] == "overlapped"
    assert "attention" not in flash and unfused["step_seconds"] != flash["step_seconds"]


# --- pipeline exchange ----------------------------------------------------------------------------

def test_megatron_exchange_scatters_sends_over_tp_and_gathers_them_on_arrival():
    traced, _ = trace(TraceRequest("tiny-gpt", "tp=2,pp=2,dp=1,zero=1", 2, 16, 4))
    out = with_pipeline_p2p(traced, "megatron")
    first, second = traced.stages
    sent = [op for op in first.forward if is_p2p(op)][0]
    sent_back = [op for op in second.backward if is_p2p(op)][0]
    new_first, new_second = out.stages
    assert [op.bytes for op in new_first.forward if is_p2p(op)] == [sent.bytes / 2]
    assert [op.bytes for op in new_second.backward if is_p2p(op)] == [sent_back.bytes / 2]
    gather = new_second.forward[0]
    assert (gather.name, gather.kind, gather.bytes, gather.group_size, gather.dim) == (
        RECEIVED_GATHER, "all_gather", sent.bytes, 2, "tp")
    assert new_first.backward[0].name == RECEIVED_GATHER and new_first.backward[0].bytes == sent_back.bytes
    assert RECEIVED_GATHER not in [op.name for op in recomputed_ops(new_second, "full")]
    assert out.p2p_blocking and not traced.p2p_blocking
    # sequence parallelism sends the rank's slice already: nothing to scatter or gather
    sp = with_pipeline_p2p(traced, "megatron", sequence_parallel=True)
    assert sp.stages == traced.stages and sp.p2p_blocking
    assert with_pipeline_p2p(traced, "program") is traced


@given(pp=st.integers(2, 4), m=st.integers(1, 8), send=st.floats(0.0, 0.5))
@settings(max_examples=40, deadline=None)
def test_a_blocking_send_never_shortens_the_step_and_costs_nothing_when_free(pp, m, send):
    link = 1e-6 + send * PROFILE.intra_bw  # bytes a send of `send` seconds moves over NVLink
    stages = []
    for k in range(pp):
        forward = (timed("f", 1.0),) + ((CommOp("pp_send_activations", "send", link, 2, 1, "pp"),)
                                        if k < pp - 1 else ())
        backward = (timed("b", 2.0),) + ((CommOp("pp_send_gradients", "send", link, 2, 1, "pp"),) if k else ())
        stages.append(stage(k, forward=forward, backward=backward))
    base = with_stages(uniform_trace(pp, m), stages)
    blocking = replace(base, p2p_blocking=True)
    assert simulate(blocking, PROFILE).step_seconds >= simulate(base, PROFILE).step_seconds - 1e-12
    free = with_stages(base, [replace(s, forward=tuple(replace(op, bytes=0.0) if is_p2p(op) else op
                                                       for op in s.forward),
                                      backward=tuple(replace(op, bytes=0.0) if is_p2p(op) else op
                                                     for op in s.backward)) for s in stages])
    lat = simulate(replace(free, p2p_blocking=True), PROFILE).step_seconds - simulate(free, PROFILE).step_seconds
    assert lat <= 2 * m * pp * PROFILE.intra_node_latency + 1e-12  # only the links' latency remains


# --- dropout on the residual stream ---------------------------------------------------------------

@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_hidden_dropout_adds_a_mask_per_sublayer_and_a_backward_kernel_of_its_own(sequence_parallel):
    s = stage(0, forward=(timed("f0", MS), _attention(), timed("f2", MS)),
              backward=(_attention("_backward"), timed("b1", MS)), grad_sync=(_bucket(MS),), grad_sync_after=(2,))
    tp = 4
    trace = replace(with_stages(uniform_trace(1, 2), [s]), tp=tp)
    out = with_hidden_dropout(trace, 0.1, sequence_parallel).stages[0]
    b, heads, sq, _, d = SHAPE
    residual = b * sq * heads * d * (1 if sequence_parallel else tp)  # the rank's b x s x h (s / tp with SP)
    assert [op.name for op in out.forward] == ["f0", _attention().name, "hidden_dropout_masks", "f2"]
    assert out.forward[2].bytes == 2 * residual  # two one-byte masks a layer
    assert out.backward[1].name == "hidden_dropout_backward" and out.backward[1].bytes == 2 * 5 * residual
    assert out.grad_sync_after == (3,)  # still after b1
    assert "hidden_dropout_masks" in [op.name for op in recomputed_ops(out, "full")]
    assert with_hidden_dropout(trace, 0.0) is trace
    with pytest.raises(EmulatorError, match="hidden_dropout"):
        with_hidden_dropout(trace, 1.0)
