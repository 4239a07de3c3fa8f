"""Context parallelism (cp > 1, issue 29): each sequence split in cp chunks over real gloo
process groups, attention over the cp group's all-gathered keys and values with the causal
mask and the positions offset by the chunk's start (parallelism/training/context_parallel.py).

The oracle is a single-rank run (tests/support/first_step.py): after one step every rank's
box of Adam's first moment equals the same box of the single-rank gradient. A chunk that
attends only to itself, an unshifted causal mask, positions restarting at 0 in every chunk,
or gradients averaged over dp alone each put some tensor off by O(1). Then online switches
tp=2,cp=2 <-> pp=2,dp=2 (and cp with ZeRO-3), bit-exact against the checkpoint path,
verified, with training going on as an unswitched run does.
"""
from __future__ import annotations

import dataclasses

import pytest

from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import box_shape, rank_boxes
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.training.parallel import ParallelTrainer, TrainConfig, TrainingError, check_trainable, initial_shards
from parallelism.training.run import Switch
from tests.support.first_step import boxes_off
from tests.support.moe_routes import moe_boxes_off_the_single_rank
from tests.support.switched_training import check_switched_training
from tests.support.tiny_models import write_tiny_gpt2_style

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-gpt", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "tp=2,cp=2,zero=1"
SWITCHES = [Switch(2, "pp=2,dp=2,zero=1"), Switch(4, "cp=2,dp=2,zero=3"), Switch(6, START)]
STEPS = 8


def _first_step(rank: int, world: int, config: TrainConfig, layout: str) -> dict:
    """exp_avg boxes after one step, the loss, and whether the handed-over shards are
    exactly the planner's boxes of this rank (run_ranks' fn)."""
    placement = place(config.tensors, layout)
    trainer = ParallelTrainer(config, layout, rank, initial_shards(placement, rank, config.seed))
    loss = trainer.step().loss
    shards, _ = trainer.hand_over()
    expected = rank_boxes(placement, rank)
    boxes_ok = set(shards) == set(expected) and all(
        tuple(s.data.shape) == box_shape(s.tensor, expected[k]) and s.box == expected[k] for k, s in shards.items())
    return {"moments": {(k[0], s.box): s.data.float().numpy() for k, s in shards.items() if k[1] == "exp_avg"},
            "loss": loss, "boxes_ok": boxes_ok}


@pytest.fixture(scope="module")
def tiny_gpt2_style(tmp_path_factory) -> str:
    return write_tiny_gpt2_style(tmp_path_factory.mktemp("gpt2-style"))


_SINGLE: dict[str, dict] = {}


def _single(config: TrainConfig) -> dict:
    if config.model not in _SINGLE:
        _SINGLE[config.model] = run_ranks(1, _first_step, config, "tp=1,pp=1,dp=1,zero=0", timeout_s=120)[0]
    return _SINGLE[config.model]


@pytest.mark.parametrize("layout,style", [
    ("tp=2,cp=2,zero=1", "llama"),
    ("cp=2,dp=2,zero=1", "llama"),
    ("cp=4,zero=1", "llama"),
    ("cp=2,pp=2,zero=3", "llama"),
    ("tp=2,cp=2,zero=1", "gpt"),  # learned positions offset by the chunk's start
])
def test_gradients_and_loss_match_a_single_rank(layout, style, request) -> None:
    config = CONFIG
    if style == "gpt":
        config = dataclasses.replace(CONFIG, model=request.getfixturevalue("tiny_gpt2_style"))
    single = _single(config)
    ranks = run_ranks(4, _first_step, config, layout, timeout_s=200)
    assert all(r["boxes_ok"] for r in ranks)  # the trainer holds exactly the planner's boxes
    # gpt style has k biases, whose gradient is zero in exact arithmetic (boxes_off's floor).
    off, checked = boxes_off(config, single["moments"], [r["moments"] for r in ranks],
                             floor=1e-4 if style == "gpt" else 0.0)
    assert off == []
    assert set(checked) == set(range(len(config.tensors.tensors)))
    # The global mean loss over every token of the batch, as the single rank computes it.
    assert all(abs(r["loss"] - single["loss"]) < 1e-2 for r in ranks), ([r["loss"] for r in ranks], single["loss"])


def test_switches_into_and_out_of_context_parallelism_are_exact_verified_and_train_on(tmp_path) -> None:
    check_switched_training(CONFIG, START, SWITCHES, STEPS, str(tmp_path))


@pytest.mark.parametrize("config,layout,message", [
    (dataclasses.replace(CONFIG, seq_len=15), "cp=2", r"cp=2: seq 15 is not a multiple of 2"),
    (dataclasses.replace(CONFIG, seq_len=18, sequence_parallel=True), "tp=2,cp=2",
     r"each of the cp=2 chunks of the sequence over tp=2: seq 18 is not a multiple of 4"),
])
def test_context_parallelism_refuses_a_sequence_it_cannot_split(config, layout, message) -> None:
    with pytest.raises(TrainingError, match=message):
        check_trainable(config, place(get_model(config.model), layout))


@pytest.mark.parametrize("layout", ["tp=2,cp=2", "cp=2,pp=2,vpp=2", "cp=4,dp=2,zero=3", "cp=2,tp=4"])
def test_context_parallel_layouts_are_trainable(layout) -> None:
    check_trainable(CONFIG, place(get_model(CONFIG.model), layout))


def test_moe_with_context_and_expert_parallelism_matches_a_single_rank_routed_alike() -> None:
    """Experts sharded over ep within dp x cp (ep=2 over the cp=2 ranks of one sequence);
    the single run routed as the parallel one (tests/support/moe_routes.py), positions
    keyed by their place in the whole sequence."""
    config = dataclasses.replace(CONFIG, model="tiny-moe")
    off, _, routes = moe_boxes_off_the_single_rank(config, "cp=2,dp=2,ep=2,zero=1", 4)
    assert off == []
    assert routes == 3 * config.global_batch * config.seq_len  # every token of the batch, in each MoE layer
