"""A tied embedding and head (Llama 3.2 1B/3B, Gemma, GPT-2/3, small Qwen) under tensor and
pipeline parallelism, on real gloo process groups (issue 13).

Under tp the head is the vocab-parallel embedding's weight (rows split over tp, as an
untied head's); with pp > 1 the first and the last stage each hold the weight and sum
their two gradients before the optimizer step (Megatron-LM's embedding group), so the two
copies stay equal. The oracle is a single-rank run: after one step Adam's first moment is
(1 - beta1) x the gradient, so every rank's box of it must equal the same box of the
single-rank gradient -- the tied weight's on both end stages the sum of the embedding's and
the head's gradients (a copy updated by one of them alone is off by O(1)). Then online
switches into and out of tied pipelines, bit-exact against the checkpoint path, verified,
with training going on as an unswitched run does.
"""
from __future__ import annotations

import pytest

from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.training.parallel import TIED_WEIGHT, TrainConfig
from parallelism.training.run import Switch
from tests.support.switched_training import check_switched_training
from tests.support.first_step import boxes_off_the_single_rank

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-gpt-tied", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "tp=2,pp=2,dp=1,zero=1"
SWITCHES = [Switch(2, "tp=2,pp=1,dp=2,zero=1"), Switch(4, "tp=1,pp=2,dp=2,zero=3"), Switch(6, START)]
STEPS = 8


def test_the_model_ties_its_embedding_and_head() -> None:
    spec = get_model(CONFIG.model)
    assert "llm.head.weight" not in {t.name for t in spec.tensors}
    embed = next(t for t in spec.tensors if t.name == TIED_WEIGHT)
    assert embed.split.place == "first+last"  # one logical tensor, held by both end stages


@pytest.mark.parametrize("layout,world", [("tp=2,pp=1,dp=1,zero=0", 2), ("tp=1,pp=2,dp=1,zero=0", 2),
                                          ("tp=2,pp=2,dp=1,zero=1", 4), ("tp=1,pp=2,dp=2,zero=3", 4)])
def test_gradients_match_a_single_rank(layout: str, world: int) -> None:
    off, checked = boxes_off_the_single_rank(CONFIG, layout, world)
    assert off == []
    spec = get_model(CONFIG.model)
    tied = next(i for i, t in enumerate(spec.tensors) if t.name == TIED_WEIGHT)
    stages = place(spec, layout).modules["llm"].pp
    assert checked.count(tied) >= min(stages, 2)  # with pp > 1 both end stages hold (and checked) the tied weight


def test_switches_into_and_out_of_tied_pipelines_are_exact_verified_and_train_on(tmp_path) -> None:
    check_switched_training(CONFIG, START, SWITCHES, STEPS, str(tmp_path))
