"""kv heads replicated over tp (issue 29), emulated as the trainer runs them: tiny-gpt's 2 kv
heads under tp=4 are traced from the same program, so the optimizer step sums the k/v
gradients over the 2 TP ranks sharing a head (dim "kv", one flat all-reduce), and the
static memory is the rank's contract shards, the replicated heads included."""
from __future__ import annotations

import math

import pytest

from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.engine.shards import DTYPES, box_shape, rank_boxes
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place

pytestmark = pytest.mark.timeout(300)


def test_replicated_heads_sum_their_gradients_and_memory_is_the_ranks_shards() -> None:
    spec = get_model("tiny-gpt")
    layout = "tp=4,pp=1,dp=1,zero=1"
    traced, _ = trace(TraceRequest(model="tiny-gpt", layout=layout, micro_batch=1, seq=32, micro_batches=2),
                      use_cache=False)
    (stage,) = traced.stages
    kv_ops = [op for op in stage.optimizer if getattr(op, "dim", None) == "kv"]
    assert len(kv_ops) == 1 and kv_ops[0].kind == "all_reduce" and kv_ops[0].group_size == 2
    boxes = rank_boxes(place(spec, layout), 0)
    heads = [i for i, t in enumerate(spec.tensors) if t.name.endswith((".attn.k.weight", ".attn.v.weight"))]
    assert kv_ops[0].bytes == sum(math.prod(box_shape(spec.tensors[i], boxes[(i, "param")])) * 4 for i in heads)

    def state_bytes(states):
        return sum(math.prod(box_shape(spec.tensors[i], box)) * DTYPES[s].itemsize
                   for (i, s), box in boxes.items() if s in states)
    assert stage.memory.params == state_bytes({"param"})
    assert stage.memory.optimizer == state_bytes({"master", "exp_avg", "exp_avg_sq"})
