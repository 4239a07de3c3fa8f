"""MoE layers emulated as the trainer runs them (issue 29): tiny-moe traced from the same
program on fake tensors, where routing has no values and is taken as balanced. Under ep
the forward sends every (token, expert) row to its owner and back (all_to_all, dim "ep",
after the counts' exchange), the backward the same two the other way; the experts'
gradients are synced over the ranks holding the same experts (data-parallel sync); and
the static memory is the rank's contract shards, the expert boxes included."""
from __future__ import annotations

import math

import pytest

from parallelism.emulator.search_space import static_bytes
from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.engine.shards import DTYPES, box_shape, rank_boxes
from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.placement import layer_stages, place

pytestmark = pytest.mark.timeout(300)

MODEL, MB, SEQ, M = "tiny-moe", 1, 32, 2


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _state_bytes(placement, rank: int, states: set[str]) -> int:
    spec = placement.model
    return sum(math.prod(box_shape(spec.tensors[i], box)) * DTYPES[s].itemsize
               for (i, s), box in rank_boxes(placement, rank).items() if s in states)


@pytest.mark.parametrize("layout", ["dp=2,ep=2,zero=1", "dp=4,ep=2,zero=1", "tp=2,dp=2,ep=2,zero=3",
                                    "pp=2,dp=2,ep=2,zero=0", "tp=2,dp=2,zero=1"])
def test_memory_is_the_ranks_shards_and_the_experts_dispatch_is_all_to_all(layout: str) -> None:
    spec, config = get_model(MODEL), get_config(MODEL).llm
    placement = place(spec, layout)
    ml = placement.modules["llm"]
    traced, _ = trace(TraceRequest(MODEL, layout, MB, SEQ, M), use_cache=False)
    assert traced.ep == ml.ep
    for stage in traced.stages:
        rank = stage.stage * ml.dp * ml.tp
        if ml.zero == 3:  # FSDP2: the fp32 shards are the masters (params), the optimizer holds the moments
            assert stage.memory.params == _state_bytes(placement, rank, {"master"})
            assert stage.memory.optimizer == _state_bytes(placement, rank, {"exp_avg", "exp_avg_sq"})
        else:
            assert stage.memory.params == _state_bytes(placement, rank, {"param"})
            assert stage.memory.optimizer == _state_bytes(placement, rank, {"master", "exp_avg", "exp_avg_sq"})
        moe_layers = sum(1 for i, s in enumerate(layer_stages(config.layers, ml.pp))
                         if s == stage.stage and config.is_moe_layer(i))
        forward = [op for op in stage.forward if getattr(op, "kind", None) == "all_to_all"]
        backward = [op for op in stage.backward if getattr(op, "kind", None) == "all_to_all"]
        if ml.ep == 1:
            assert forward == backward == []
            continue
        assert all(op.dim == "ep" and op.group_size == ml.ep for op in forward + backward)
        # per MoE layer: the counts, the rows out, the outputs back; the backward sends the two back
        assert len(forward) == 3 * moe_layers and len(backward) == 2 * moe_layers
        rows = MB * SEQ * config.top_k  # every (token, expert) row, balanced: all of them leave and return
        assert sorted(op.bytes for op in forward)[-2 * moe_layers:] == [rows * config.hidden * 2] * 2 * moe_layers
        expert_sync = [op for op in stage.grad_sync if op.group_size == ml.dp // ml.ep]
        if ml.dp // ml.ep > 1 and ml.zero < 3:  # ShardedAdamW: one flat fp32 all-reduce of the experts' boxes
            experts = [i for i, t in enumerate(spec.tensors) if t.split.ep_dim is not None]
            boxes = rank_boxes(placement, rank)
            assert [op.bytes for op in expert_sync] == [sum(
                math.prod(box_shape(spec.tensors[i], boxes[(i, "param")])) * 4 for i in experts if (i, "param") in boxes)]
    assert static_bytes(spec, layout) == max(s.memory.static for s in traced.stages)


def test_the_search_enumerates_expert_parallelism_for_a_moe_model() -> None:
    from parallelism.emulator.search_space import SearchRequest, candidate_layouts

    request = SearchRequest(model=MODEL, gpus=4, gpu="h100", global_batch=8, seq=SEQ, micro_batches=(1,), zero=(1,))
    layouts = [layout for layout, _ in candidate_layouts(request)]
    assert {"tp=1,pp=1,dp=4,ep=4,zero=1", "tp=2,pp=1,dp=2,ep=2,zero=1", "tp=1,pp=1,dp=4,zero=1"} <= set(layouts)
    for layout in layouts:
        ml = place(get_model(MODEL), layout).modules["llm"]  # a layout rule broken would raise here
        assert ml.world == 4 and ml.dp % ml.ep == 0
    eps = {(ml.tp, ml.pp, ml.dp): set() for ml in (place(get_model(MODEL), lay).modules["llm"] for lay in layouts)}
    for ml in (place(get_model(MODEL), lay).modules["llm"] for lay in layouts):
        eps[(ml.tp, ml.pp, ml.dp)].add(ml.ep)
    assert eps[(1, 1, 4)] == {1, 2, 4} and eps[(2, 1, 2)] == {1, 2} and eps[(4, 1, 1)] == {1}
