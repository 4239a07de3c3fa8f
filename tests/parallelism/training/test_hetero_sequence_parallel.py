"""Sequence parallelism in the heterogeneous trainer (tiny-vlm's LLM; the encoder runs
without it): the combined sequence of 17 image tokens + 15 text tokens (32, a multiple of
tp=2 and tp=4) is split over the LLM's tp between its layers and pipeline stages.

Oracles: a 1-rank run of the same config, and the same LLM layout without SP. SP changes
where norms and residual adds run (on (P+T)/tp positions) and turns the TP all-reduces
into reduce-scatter + all-gather; the maths is the same, so SP runs must match the 1-rank
run within the layout noise test_hetero.py defines (losses: 3 x max(noise, 1e-3), with
noise the 1-rank vs homogeneous dp=3 difference; gradients through Adam's first moment
after one step: per tensor, the largest deviation relative to the tensor's largest entry
within 3 x max(homogeneous deviation, 0.02)), and match the no-SP run of their LLM layout
within the same bounds. The encoder's gradients come only through the image-token
gradient the boundary returns, so they check the first stage's split (its backward
all-gather) and the boundary's backward; the last stage's gather is checked by the head's
and final norm's gradients. A wrong split or gather (positions shifted, image positions
predicted, a missing reduction) is O(1) off on most tensors.

Every run also hands its state over after the first step and adopts it in a new trainer
(exp_avg boxes come from that hand-over). SP moves no state box (same placement, only
activations differ); test_hetero_switch.py's "sequence-parallel" schedule switches into an
SP layout and out of it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.placement import place
from parallelism.training.hetero import check_hetero_trainable
from parallelism.training.image_text_stage import ImageTextStage
from parallelism.training.parallel import TrainConfig, TrainingError
from tests.support.hetero_parity import check_gradient_parity, check_loss_parity, run_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CONFIG = TrainConfig(model="tiny-vlm", global_batch=9, seq_len=15, micro_batches=3, lr=3e-3)
SP = replace(CONFIG, sequence_parallel=True)
STEPS = 3
# name: (layout, world, the no-SP run of the same LLM layout)
SP_RUNS = {
    "sp-tp2": ("encoder:dp=2;llm:tp=2", 2, "tp2"),
    "sp-tp2-pp2": ("encoder:dp=4;llm:tp=2,pp=2", 4, "tp2-pp2"),           # p2p of [b, 32/2, H] slices, 1F1B
    "sp-non-colocated": ("encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3", 4, "tp2"),  # image tokens from other ranks
    "sp-kv-replicated": ("encoder:dp=4;llm:tp=4", 4, None),                # 2 kv heads over tp=4, 32/4 positions
}
PLAIN_RUNS = {"single": ("tp=1", 1), "homogeneous": ("dp=3", 3),
              "tp2": ("encoder:dp=2;llm:tp=2", 2), "tp2-pp2": ("encoder:dp=4;llm:tp=2,pp=2", 4)}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_layouts({**{name: (layout, world, CONFIG) for name, (layout, world) in PLAIN_RUNS.items()},
                        **{name: (layout, world, SP) for name, (layout, world, _) in SP_RUNS.items()}}, STEPS)


def _references(name: str) -> list[str]:
    return ["single"] + ([SP_RUNS[name][2]] if SP_RUNS[name][2] else [])


@pytest.mark.parametrize("name", list(SP_RUNS))
def test_sequence_parallel_losses_match_a_single_rank_and_the_plain_layout(runs, name) -> None:
    check_loss_parity(runs, name, _references(name))


@pytest.mark.parametrize("name", list(SP_RUNS))
def test_sequence_parallel_gradients_match_a_single_rank_and_the_plain_layout(runs, name) -> None:
    # floor=0: each tensor's error relative to its own largest entry, as this test has always judged it
    check_gradient_parity(runs, name, _references(name), CONFIG.model, floor=0.0)


def test_a_sequence_the_tp_ranks_cannot_split_evenly_is_refused_with_the_rule() -> None:
    """17 image tokens + 16 text tokens = 33 positions: not a multiple of tp=2 or 4; 32 is."""
    model = get_model(CONFIG.model)
    for tp in (2, 4):
        with pytest.raises(TrainingError, match=rf"sequence parallelism .* 17 \+ seq 16 = 33 is not a multiple of {tp}"):
            check_hetero_trainable(replace(SP, seq_len=16), place(model, f"encoder:dp={tp};llm:tp={tp}"))
        check_hetero_trainable(SP, place(model, f"encoder:dp={tp};llm:tp={tp}"))
    check_hetero_trainable(replace(SP, seq_len=16), place(model, "dp=3"))  # tp=1: nothing to split


def test_the_stage_shapes_follow_the_split() -> None:
    """The sequence's split and gather modules exist only on the end stages, and only under SP."""
    from parallelism.training.model import build_training_model

    model = build_training_model(get_config(CONFIG.model), device="meta")
    first, middle, last = (ImageTextStage(model, s, 3, sequence_shards=2) for s in range(3))
    assert first.llm.seq_scatter is not None and first.llm.seq_gather is None
    assert middle.llm.seq_scatter is None and middle.llm.seq_gather is None
    assert last.llm.seq_scatter is None and last.llm.seq_gather is not None
    plain = ImageTextStage(model, 0, 1)
    assert plain.llm.seq_scatter is None and plain.llm.seq_gather is None
