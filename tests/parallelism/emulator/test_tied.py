"""A tied embedding and head, emulated as the trainer runs it (issue 13): the same program
traced, so with pp > 1 the end stages hold the embedding's copy and, in the optimizer step,
all-reduce its gradient between themselves (dim "embed"); the middle stages do not."""
from __future__ import annotations

import pytest

from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.layout.catalog import get_model

pytestmark = pytest.mark.timeout(300)


def test_the_end_stages_sum_the_tied_gradient_and_the_middle_ones_do_not() -> None:
    spec = get_model("tiny-gpt-tied")
    vocab, hidden = next(t.shape for t in spec.tensors if t.name == "llm.embed.weight")
    traced, _ = trace(TraceRequest(model="tiny-gpt-tied", layout="tp=1,pp=4,dp=1,zero=1", micro_batch=1, seq=32,
                                   micro_batches=4), use_cache=False)
    embed_ops = {s.stage: [op for op in s.optimizer if getattr(op, "dim", None) == "embed"] for s in traced.stages}
    assert [len(embed_ops[s]) for s in range(4)] == [1, 0, 0, 1]
    for stage in (0, 3):
        (op,) = embed_ops[stage]
        assert op.kind == "all_reduce" and op.group_size == 2
        assert op.bytes == vocab * hidden * 4  # the fp32 gradient of the whole (tp=1) embedding
    # The last stage holds the embedding as its head, the middle ones hold neither.
    params = [s.memory.params for s in traced.stages]
    assert params[3] > params[2] and params[0] > params[1]

