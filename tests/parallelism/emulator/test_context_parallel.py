"""Context parallelism (issue 29) emulated as the trainer runs it: the traced program is the
trainer's (parallelism/training/context_parallel.py), so every attention all-gathers K and V
over the cp group in the forward (dim "cp") and reduce-scatters their gradients in the
backward, the traced rank is the last cp rank (its chunk attends over the whole sequence, with
the bottom-right causal mask's FLOPs), and the static memory is that rank's contract shards."""
from __future__ import annotations

import math

import pytest

from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.recorder import lower_right_causal_fraction
from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.engine.shards import DTYPES, box_shape, rank_boxes
from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.placement import place

pytestmark = pytest.mark.timeout(300)

SEQ = 32


@pytest.mark.parametrize("layout,tp", [("tp=2,cp=2,zero=1", 2), ("cp=2,zero=1", 1)])
def test_attention_gathers_the_sequence_over_cp_and_memory_is_the_ranks_shards(layout, tp) -> None:
    """cp=2 alone has cp's group equal to dp's (dp x cp = 2 ranks): the K/V all-gathers are
    still cp's and the gradient all-reduce dp's."""
    spec, c = get_model("tiny-gpt"), get_config("tiny-gpt").llm
    traced, _ = trace(TraceRequest(model="tiny-gpt", layout=layout, micro_batch=1, seq=SEQ, micro_batches=2),
                      use_cache=False)
    assert traced.cp == 2 and traced.world == 2 * tp
    (stage,) = traced.stages
    gathers = [op for op in stage.forward if getattr(op, "dim", None) == "cp"]
    scatters = [op for op in stage.backward if getattr(op, "dim", None) == "cp"]
    assert [op.kind for op in gathers] == ["all_gather"] * 2 * c.layers  # K and V of every layer
    assert [op.kind for op in scatters] == ["reduce_scatter"] * 2 * c.layers
    kv_bytes = 1 * (c.kv_heads // tp) * SEQ * c.head_dim * 2  # the gathered bf16 K of the whole sequence
    assert all(op.bytes == kv_bytes and op.group_size == 2 for op in gathers + scatters)
    assert [op.dim for op in stage.grad_sync] == ["dp"]  # averaged over dp x cp
    # The last chunk's queries over every key, bottom-right causal.
    attention = [op for op in stage.forward if op.kind == "attention"]
    assert len(attention) == c.layers and all(op.shape[2:4] == (SEQ // 2, SEQ) for op in attention)
    full = 4 * 1 * (c.heads // tp) * (SEQ // 2) * SEQ * c.head_dim
    assert attention[0].flops == pytest.approx(full * lower_right_causal_fraction(SEQ // 2, SEQ))
    # Static memory: the traced rank (tp rank 0 of the last cp rank) holds its contract boxes.
    boxes = rank_boxes(place(spec, layout), tp * 1)

    def state_bytes(states):
        return sum(math.prod(box_shape(spec.tensors[i], box)) * DTYPES[s].itemsize
                   for (i, s), box in boxes.items() if s in states)
    assert stage.memory.params == state_bytes({"param"})
    assert stage.memory.optimizer == state_bytes({"master", "exp_avg", "exp_avg_sq"})


def test_lower_right_causal_fraction() -> None:
    assert lower_right_causal_fraction(4, 4) == pytest.approx(10 / 16)  # the ordinary causal square
    assert lower_right_causal_fraction(2, 4) == pytest.approx((3 + 4) / 8)  # rows see 3 and 4 keys


def test_llama3_8b_with_context_parallelism_emulates_with_less_activation_memory() -> None:
    """cp=2 halves the tokens a rank holds per micro-batch: its activations are well under
    those of dp=2 at the same sequence length, while the states are the same size (ZeRO over
    dp x cp, as over dp)."""
    def run(layout: str) -> dict:
        return emulate(EmulateRequest(model="llama3-8b", layout=layout, gpus=16, gpu="h100", global_batch=16,
                                      micro_batch=1, seq=8192), use_cache=False)
    cp, dp = run("tp=8,cp=2,zero=1"), run("tp=8,dp=2,zero=1")
    (cp_row,), (dp_row,) = cp["memory"]["per_stage"], dp["memory"]["per_stage"]
    assert cp_row["params"] == dp_row["params"] and cp_row["optimizer"] == pytest.approx(dp_row["optimizer"], rel=1e-3)
    assert cp_row["activations"] < 0.75 * dp_row["activations"]
    assert cp["breakdown"]["tp_comm"] > 0 and cp["step_seconds"] > 0
