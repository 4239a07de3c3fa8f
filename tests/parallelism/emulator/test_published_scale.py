"""Issue 13's scale check: published models as published, traced at about a thousand GPUs
(the same program the trainer runs), report the static memory that the analytic count of
a rank's boxes gives (parallelism/engine/shards.py rank_boxes, the planner's own maths)."""
from __future__ import annotations

import numpy as np
import pytest

from parallelism.emulator.trace_build import TraceRequest
from parallelism.emulator.tracer import trace
from parallelism.engine.shards import box_shape, rank_boxes
from parallelism.layout.placement import place

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_TRACE_CACHE", str(tmp_path / "traces"))


def _traced_against_the_analytic_count(request: TraceRequest, stages_traced: int) -> dict:
    """Each stage's params (bf16), grads (fp32) and optimizer (fp32 master + two moments of
    the rank's ZeRO chunk) against its first rank's boxes; returns the traced stages by index."""
    traced, info = trace(request, use_cache=False)
    assert info["stages_traced"] == stages_traced  # the other stages are the same program
    placement = place(request.tensors, request.layout)
    spec, ml = placement.model, next(iter(placement.modules.values()))
    stages = {s.stage: s for s in traced.stages}
    assert sorted(stages) == list(range(ml.pp))
    for stage, traced_stage in stages.items():
        boxes = rank_boxes(placement, stage * ml.dp * ml.tp)  # (pp, dp, tp) order: the stage's first rank
        elements = {state: sum(int(np.prod(box_shape(spec.tensors[i], box))) for (i, s), box in boxes.items()
                               if s == state) for state in ("param", "master")}
        assert elements["param"] > 0
        assert traced_stage.memory.params == 2 * elements["param"], stage
        assert traced_stage.memory.grads == 4 * elements["param"], stage
        assert traced_stage.memory.optimizer == 12 * elements["master"], stage
    return stages


def test_gpt3_175b_as_published_tied_at_tp8_pp8_on_1024_gpus() -> None:
    """The config.json as published ties embedding and head: the first and last stages each
    hold a tp shard of the one embedding matrix, the middle ones hold none."""
    request = TraceRequest(model="benchmarks/published_models/gpt-175b/config.json", layout="tp=8,pp=8,dp=16,zero=0",
                           micro_batch=1, seq=2048, micro_batches=96)
    assert request.model_config.llm.tied
    stages = _traced_against_the_analytic_count(request, stages_traced=3)
    placement = place(request.tensors, request.layout)
    embed = next(i for i, t in enumerate(placement.model.tensors) if t.name == "llm.embed.weight")
    for stage in stages:
        assert ((embed, "param") in rank_boxes(placement, stage * 128)) == (stage in (0, 7)), stage
    assert stages[0].memory.params > stages[3].memory.params < stages[7].memory.params


def test_qwen3_235b_a22b_with_ep8_at_tp4_pp8_on_1024_gpus() -> None:
    """Experts sharded over ep=8 within dp=32: a rank holds 128 / 8 = 16 of each layer's
    experts, tp-sharded, and its ZeRO-1 chunk of their optimizer state."""
    request = TraceRequest(model="qwen3-235b-a22b", layout="tp=4,pp=8,dp=32,ep=8,zero=1",
                           micro_batch=1, seq=4096, micro_batches=32)
    placement = place(request.tensors, request.layout)
    assert next(iter(placement.modules.values())).ep == 8
    _traced_against_the_analytic_count(request, stages_traced=4)
