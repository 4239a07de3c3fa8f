"""The tracer runs the real training program on fake tensors: what it records must be what
a rank of the target world really holds and computes."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from parallelism.emulator.emulate import EmulateRequest, check_request, emulate
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.trace import ComputeOp
from parallelism.emulator.tracer import TraceRequest, trace
from parallelism.engine.shards import box_shape, rank_boxes
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place

pytestmark = [pytest.mark.timeout(300)]

MODEL, MB, SEQ, M = "tiny-gpt", 2, 16, 4


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _elements(placement, rank: int, state: str, stage_tensors: set[int]) -> int:
    spec = placement.model
    return sum(int(np.prod(box_shape(spec.tensors[i], box))) for (i, s), box in rank_boxes(placement, rank).items()
               if s == state and i in stage_tensors)


@pytest.mark.parametrize("layout", ["tp=2,pp=2,dp=2,zero=1", "tp=2,pp=2,dp=2,zero=0", "tp=1,pp=2,dp=4,zero=3"])
def test_static_memory_is_the_analytic_count_of_the_ranks_boxes(layout: str) -> None:
    traced, info = trace(TraceRequest(MODEL, layout, MB, SEQ, M))
    assert info["stages_traced"] == 2  # first and last stage: dp and tp replicas are symmetric
    placement = place(get_model(MODEL), layout)
    ml = next(iter(placement.modules.values()))
    for stage in traced.stages:
        rank = stage.stage * ml.dp * ml.tp
        mine = {i for (i, _s) in rank_boxes(placement, rank)}
        param, master = (_elements(placement, rank, s, mine) for s in ("param", "master"))
        if ml.zero == 3:  # FSDP2: fp32 shards are the masters, fp32 sharded grads, two moments
            assert stage.memory.params == 4 * master and stage.memory.grads == 4 * master
            assert stage.memory.optimizer == 8 * master
        else:  # bf16 TP box, its fp32 accumulated gradient, fp32 master + two moments of the ZeRO chunk
            assert stage.memory.params == 2 * param and stage.memory.grads == 4 * param
            assert stage.memory.optimizer == 12 * master
        assert stage.memory.activations_per_microbatch > 0


def test_recorded_matmul_flops_are_the_ranks_local_matmuls() -> None:
    """Forward matmul FLOPs = 2 x tokens x the rank's local weight elements used in matmuls
    (TP shards, not global shapes: DTensor's own shape propagation is not counted)."""
    layout = "tp=2,pp=2,dp=1,zero=1"
    traced, _ = trace(TraceRequest(MODEL, layout, MB, SEQ, M))
    placement = place(get_model(MODEL), layout)
    spec = placement.model
    for stage in traced.stages:
        rank = stage.stage * 2
        weights = sum(int(np.prod(box_shape(spec.tensors[i], box)))
                      for (i, s), box in rank_boxes(placement, rank).items()
                      if s == "param" and len(spec.tensors[i].shape) == 2 and "embed" not in spec.tensors[i].name)
        matmul = sum(op.flops for op in stage.forward if isinstance(op, ComputeOp) and op.kind == "matmul")
        assert matmul == 2 * MB * SEQ * weights
        tp_comm = [op for op in stage.forward if getattr(op, "dim", None) == "tp"]
        assert tp_comm and all(op.group_size == 2 and op.nodes == 1 for op in tp_comm)
        # Every DTensor op is there as host work (its dispatch), without FLOPs or bytes.
        host = [op for op in stage.forward if isinstance(op, ComputeOp) and op.kind == "host"]
        assert any(op.name == "dtensor.mm" for op in host)
        assert all(op.flops == 0 and op.bytes == 0 for op in host)


def test_without_tensor_parallelism_no_dtensor_dispatch_is_recorded() -> None:
    traced, _ = trace(TraceRequest(MODEL, "tp=1,pp=2,dp=1,zero=1", MB, SEQ, M))
    assert not [op for st in traced.stages for op in st.forward + st.backward
                if isinstance(op, ComputeOp) and op.kind == "host"]


def test_a_second_trace_of_the_same_configuration_comes_from_the_cache() -> None:
    request = TraceRequest(MODEL, "tp=1,pp=2,dp=1,zero=1", MB, SEQ, M)
    first, info = trace(request)
    again, info2 = trace(request)
    assert not info["cached"] and info2["cached"]
    assert again == first


@pytest.mark.parametrize("changes,message", [
    ({"gpus": 6}, "needs 8 GPUs"),
    ({"global_batch": 10}, "global batch 10 is not a multiple of micro-batch 2 x dp 2 = 4"),
    ({"layout": "tp=3,pp=1,dp=2"}, "tp=3 does not divide 4 attention heads"),
    ({"recompute": "most"}, "--recompute 'most'"),
])
def test_bad_configurations_are_refused_with_the_reason(changes, message) -> None:
    base = dict(model=MODEL, layout="tp=2,pp=2,dp=2,zero=1", gpus=8, gpu="h100", global_batch=16, micro_batch=2,
                seq=SEQ)
    with pytest.raises(EmulatorError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_request(EmulateRequest(**{**base, **changes}))


def test_a_configuration_that_does_not_fit_says_so() -> None:
    result = emulate(EmulateRequest(model="llama-124m", layout="tp=1,pp=1,dp=1,zero=0", gpus=1, gpu="cpu",
                                    global_batch=64, micro_batch=64, seq=2048))
    memory = result["memory"]
    assert memory["fits"] is False and memory["peak_bytes"] > memory["capacity_bytes"]


def test_emulate_command_prints_the_contract_json() -> None:
    out = subprocess.run([sys.executable, "-m", "dynaplane", "emulate", "--model", MODEL, "--layout",
                          "tp=2,pp=2,dp=2,zero=1", "--gpus", "8", "--gpu", "h100", "--global-batch", "16",
                          "--micro-batch", "2", "--seq", str(SEQ), "--json"], capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert {"step_seconds", "tokens_per_second", "model_tflops_per_gpu", "hardware_tflops_per_gpu", "mfu", "memory",
            "breakdown", "ranks_emulated", "ranks_traced", "wall_seconds"} <= set(result)
    assert {"peak_bytes", "per_stage"} <= set(result["memory"])
    assert set(result["breakdown"]) == {"compute", "tp_comm", "dp_comm", "pp_comm", "bubble"}
    assert [s["stage"] for s in result["memory"]["per_stage"]] == [0, 1]
    assert {"stage", "params", "grads", "optimizer", "activations", "peak"} <= set(result["memory"]["per_stage"][0])
    assert result["ranks_emulated"] == 8 and result["ranks_traced"] == 2
    assert result["step_seconds"] > 0 and 0 < result["mfu"] < 1


def test_static_bytes_used_to_prune_search_equal_the_traced_static_memory() -> None:
    from parallelism.emulator.search_space import static_bytes

    for layout in ("tp=2,pp=2,dp=2,zero=1", "tp=1,pp=2,dp=4,zero=3"):
        traced, _ = trace(TraceRequest(MODEL, layout, MB, SEQ, M))
        assert static_bytes(get_model(MODEL), layout) == max(s.memory.static for s in traced.stages)


def test_search_ranks_feasible_layouts_and_compare_reports_errors_per_layout() -> None:
    from parallelism.emulator.search import SearchRequest, compare, search
    from parallelism.emulator.search_space import candidate_layouts

    request = SearchRequest(model=MODEL, gpus=4, gpu="h100", global_batch=8, seq=SEQ, top=2,
                            micro_batches=(2,), zero=(1,), max_candidates=3)
    layouts = candidate_layouts(request)
    assert ("tp=4,pp=1,dp=1,zero=1", 2) in layouts  # tiny-gpt's 2 kv heads, each replicated on 2 TP ranks
    assert all(place(get_model(MODEL), lay).world == 4 for lay, _ in layouts)
    result = search(request)
    top = result["top"]
    assert 1 <= len(top) <= 2 and result["emulated"] == 3
    assert [r["tokens_per_second"] for r in top] == sorted((r["tokens_per_second"] for r in top), reverse=True)
    base = EmulateRequest(MODEL, top[0]["layout"], 4, "h100", 8, 2, SEQ)
    both = compare([base, EmulateRequest(MODEL, "tp=3,pp=1,dp=1", 4, "h100", 8, 2, SEQ)])
    assert both[0]["tokens_per_second"] == top[0]["tokens_per_second"]
    assert "tp=3 does not divide" in both[1]["error"]


def test_interleaved_layout_is_traced_as_its_chunks() -> None:
    """vpp=2 over pp=2: the 4 virtual stages are the stages of the flat pp=4 layout (same
    chunks of layers, same per-chunk static memory and ops), labelled for the interleaved
    schedule, with p2p node spans of virtual stage k on pipeline rank k % pp."""
    inter, info = trace(TraceRequest(MODEL, "tp=1,pp=2,vpp=2,dp=2,zero=1", MB, SEQ, M, gpus_per_node=4))
    flat, _ = trace(TraceRequest(MODEL, "tp=1,pp=4,dp=2,zero=1", MB, SEQ, M, gpus_per_node=4))
    assert (inter.pp, inter.vpp, len(inter.stages)) == (2, 2, 4)
    assert info["stages_traced"] == 3  # first, middle (one layer each), last chunk
    for a, b in zip(inter.stages, flat.stages):
        assert a.stage == b.stage and a.memory == b.memory
        assert [op.name for op in a.forward] == [op.name for op in b.forward]
        assert [op.flops for op in a.backward if isinstance(op, ComputeOp)] == \
               [op.flops for op in b.backward if isinstance(op, ComputeOp)]
    # the interleaved world is 4 ranks on one node; the flat one is 8 ranks, stage 1 -> 2 crosses nodes
    sends = [op for st in inter.stages for op in st.forward + st.backward if op.name.startswith("pp_send")]
    assert len(sends) == 6 and all(op.nodes == 1 for op in sends)
    assert next(op for op in flat.stages[1].forward if op.name == "pp_send_activations").nodes == 2
    result = emulate(EmulateRequest(MODEL, "tp=1,pp=2,vpp=2,dp=2,zero=1", 4, "h100", 2 * MB * M, MB, SEQ))
    assert len(result["memory"]["per_stage"]) == 2  # per pipeline rank, chunks summed


def test_full_recompute_keeps_each_layers_input_only() -> None:
    traced, _ = trace(TraceRequest(MODEL, "tp=1,pp=2,dp=1,zero=1", MB, SEQ, M))
    hidden = 64  # tiny-gpt
    for stage in traced.stages:
        layers = 2  # 4 layers over 2 stages
        assert stage.memory.activations_full == layers * MB * SEQ * hidden * 2
        assert stage.memory.activations("full") < stage.memory.activations("none")


def test_causal_attention_counts_only_the_blocks_at_or_below_the_diagonal() -> None:
    """Flash kernels skip masked blocks: the forward attention FLOPs of a causal layer are
    4 b h s^2 d (QK^T and PV) times the causal share (s+1)/(2s), not the full square."""
    from parallelism.emulator.recorder import causal_fraction

    assert causal_fraction(SEQ, SEQ) == (SEQ + 1) / (2 * SEQ)
    assert causal_fraction(4, 8) == (1 + 2 + 3 + 4) / 32 and causal_fraction(8, 4) == (1 + 2 + 3 + 4 * 5) / 32
    traced, _ = trace(TraceRequest(MODEL, "tp=1,pp=1,dp=1,zero=1", MB, SEQ, M))
    config = get_model(MODEL)
    attention = [op for op in traced.stages[0].forward if isinstance(op, ComputeOp) and op.kind == "attention"]
    from parallelism.layout.catalog import get_config

    c = get_config(MODEL).llm
    assert len(attention) == c.layers and config is not None
    full = 4 * MB * c.heads * SEQ * SEQ * c.head_dim
    assert all(op.flops == pytest.approx(full * (SEQ + 1) / (2 * SEQ)) for op in attention)


def test_sequence_parallelism_traces_reduce_scatter_and_all_gather_on_seq_over_tp_slices() -> None:
    """Same matmul FLOPs; the TP all-reduces become reduce-scatter + all-gather; hidden states
    between stages (the p2p sends) and the activations kept for the backward shrink."""
    layout = "tp=2,pp=2,dp=1,zero=1"
    plain, _ = trace(TraceRequest(MODEL, layout, MB, SEQ, M))
    sp, _ = trace(TraceRequest(MODEL, layout, MB, SEQ, M, sequence_parallel=True))
    for a, b in zip(plain.stages, sp.stages):
        def flops(stage, kind):
            return sum(op.flops for op in stage.forward if isinstance(op, ComputeOp) and op.kind == kind)

        assert flops(a, "matmul") == flops(b, "matmul")
        kinds = {op.kind for op in b.forward if getattr(op, "dim", None) == "tp"}
        assert {"reduce_scatter", "all_gather"} <= kinds
        assert "all_reduce" not in {op.kind for op in b.forward[:-3] if getattr(op, "dim", None) == "tp"}
        assert b.memory.activations_per_microbatch < a.memory.activations_per_microbatch
        def sends(stage):
            return {op.name: op.bytes for op in stage.forward + stage.backward if getattr(op, "dim", None) == "pp"}

        assert sends(a) and {name: 2 * size for name, size in sends(b).items()} == sends(a)
    with pytest.raises(EmulatorError, match="not a multiple of 2"):
        trace(TraceRequest(MODEL, layout, MB, 15, M, sequence_parallel=True))


def test_data_parallel_collectives_move_the_analytic_bytes() -> None:
    """FSDP2 all-gathers each unit's bf16 parameters and reduce-scatters its fp32 gradients:
    the all-gather's output and the reduce-scatter's input are the whole unit (CommOp.bytes),
    so over a stage they sum to 2 and 4 bytes per parameter; the ZeRO-1 path all-reduces
    the fp32 gradients once and all-gathers the bf16 chunks once."""
    placement = place(get_model(MODEL), "tp=1,pp=1,dp=2,zero=3")
    n = sum(int(np.prod(box_shape(placement.model.tensors[i], box)))  # both dp ranks' shards: the whole stage
            for rank in (0, 1) for (i, s), box in rank_boxes(placement, rank).items() if s == "param")
    fsdp, _ = trace(TraceRequest(MODEL, "tp=1,pp=1,dp=2,zero=3", MB, SEQ, M))
    stage = fsdp.stages[0]
    assert sum(op.bytes for op in stage.grad_sync if op.kind == "reduce_scatter") == 4 * n
    forward = [op for op, phase in zip(stage.param_sync, stage.phases()) if phase == "forward"]
    assert sum(op.bytes for op in forward) == 2 * n
    zero1, _ = trace(TraceRequest(MODEL, "tp=1,pp=1,dp=2,zero=1", MB, SEQ, M))
    stage = zero1.stages[0]
    assert [op.kind for op in stage.grad_sync] == ["all_reduce"] and stage.grad_sync[0].bytes == 4 * n
    assert sum(op.bytes for op in stage.param_sync) >= 2 * n  # chunks padded to equal rows
