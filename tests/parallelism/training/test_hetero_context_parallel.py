"""Context parallelism (cp > 1) in the heterogeneous trainer's LLM (tiny-vlm; the encoder
runs without it): each LLM cp rank receives its dp share of the image tokens whole through
the boundary, builds the combined sequence (17 image + 15 text = 32 positions) and keeps its
chunk of it: with cp=2 chunk 0 holds image positions only, chunk 1 one image position and
the 15 text positions; with cp=4 two chunks hold no text at all. Attention gathers K/V over
cp (context_parallel.py), positions start at the chunk's offset; each rank's loss is its
chunk's text-token losses over the whole text (times cp, the dp x cp optimizer averages),
and the image-token gradient, spread over the cp ranks, is their sum before it returns
through the boundary.

Oracles: a 1-rank run of the same config, and for cp with tp or pp the same LLM layout
without cp; the runs must match within the layout noise test_hetero.py defines (losses: 3 x
max(noise, 1e-3), noise the 1-rank vs homogeneous dp=2 difference; gradients through Adam's
first moment after one step, per tensor relative to its largest entry (at least FLOOR x the
model's largest, for gradients zero in exact arithmetic) within 3 x max(homogeneous
deviation, 0.02)). A lost image-token gradient part (only the chunk holding the rank's image
positions returned), a text target shifted across a chunk edge or a wrong loss scale is
O(1) off on the encoder's or the LLM's tensors. Every run also hands its state over after
the first step and adopts it in a new trainer; test_hetero_switch.py's "context-parallel"
schedule switches into a cp layout and out of it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.training.hetero import check_hetero_trainable
from parallelism.training.parallel import TrainConfig, TrainingError
from tests.support.hetero_parity import (check_gradient_parity, check_loss_parity, loss_bound, moment_errors,
                                         run_layouts)

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CONFIG = TrainConfig(model="tiny-vlm", global_batch=8, seq_len=15, micro_batches=4, lr=3e-3)
STEPS = 3
# name: (layout, world, config, the run of the same LLM layout without cp)
CP_RUNS = {
    "cp2": ("encoder:dp=2;llm:cp=2", 2, CONFIG, None),
    "cp4": ("encoder:dp=4;llm:cp=4", 4, CONFIG, None),                      # chunks of 8: two image-only
    "cp2-dp2": ("encoder:dp=4;llm:dp=2,cp=2", 4, CONFIG, None),
    "cp2-pp2-vpp2": ("encoder:dp=4;llm:cp=2,pp=2,vpp=2", 4, CONFIG, "pp2"),  # K/V gathers in every chunk
    # sequence parallelism too: each 16-position chunk split over tp=2
    "cp2-tp2-sp": ("encoder:dp=4;llm:tp=2,cp=2", 4, replace(CONFIG, sequence_parallel=True), "tp2"),
    "cp2-non-colocated": ("encoder:dp=2,ranks=0-1;llm:cp=2,ranks=2-3", 4, CONFIG, None),
    # zero=3 (FSDP2) in both modules: the LLM's shards cut over its data index (dp x cp)
    "cp2-dp2-zero3": ("encoder:dp=4,zero=3;llm:dp=2,cp=2,zero=3", 4, CONFIG, None),
}
PLAIN_RUNS = {"single": ("tp=1", 1), "homogeneous": ("dp=2", 2), "pp2": ("encoder:dp=2;llm:pp=2", 2),
              "tp2": ("encoder:dp=2;llm:tp=2", 2)}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_layouts({**{name: (layout, world, CONFIG) for name, (layout, world) in PLAIN_RUNS.items()},
                        **{name: (layout, world, config) for name, (layout, world, config, _) in CP_RUNS.items()}},
                       STEPS)


def _references(name: str) -> list[str]:
    return ["single"] + ([CP_RUNS[name][3]] if CP_RUNS[name][3] else [])


@pytest.mark.parametrize("name", list(CP_RUNS))
def test_context_parallel_losses_match_a_single_rank_and_the_layout_without_cp(runs, name) -> None:
    check_loss_parity(runs, name, _references(name))


@pytest.mark.parametrize("name", list(CP_RUNS))
def test_context_parallel_gradients_match_a_single_rank_and_the_layout_without_cp(runs, name) -> None:
    check_gradient_parity(runs, name, _references(name), CONFIG.model)


@pytest.mark.parametrize("name", list(CP_RUNS))
def test_every_rank_hands_over_the_planners_boxes(runs, name) -> None:
    assert all(result["boxes_ok"] for result in runs[name])


TIED = replace(CONFIG, model="tiny-vlm-tied")
# A tied embedding's end stages pair up per data index (dp x cp) and tp: with llm cp=2, pp=2
# the cp rank 1 ranks have their own pair (a pairing over dp alone would leave their copies unsummed).
TIED_CP_RUNS = {"tied-cp2-pp2": "encoder:dp=4;llm:cp=2,pp=2",
                "tied-cp2-pp2-zero3": "encoder:dp=4,zero=3;llm:cp=2,pp=2,zero=3"}


@pytest.fixture(scope="module")
def tied_runs() -> dict:
    return run_layouts({"single": ("tp=1", 1, TIED), **{name: (layout, 4, TIED) for name, layout in TIED_CP_RUNS.items()}},
                       STEPS)


@pytest.mark.parametrize("name", list(TIED_CP_RUNS))
def test_a_tied_llm_under_context_parallelism_matches_a_single_rank(runs, tied_runs, name) -> None:
    noise, allowed = loss_bound(runs)
    for step, (a, b) in enumerate(zip(tied_runs[name][0]["losses"], tied_runs["single"][0]["losses"])):
        assert abs(a - b) <= allowed, (name, step, a, b, noise)
    grad_noise = moment_errors(runs["homogeneous"], runs["single"], CONFIG.model)
    errors = moment_errors(tied_runs[name], tied_runs["single"], TIED.model)
    assert set(errors) == {t.name for t in get_model(TIED.model).tensors}
    for tensor, error in errors.items():
        assert error <= 3 * max(grad_noise.get(tensor, 0.0), 0.02), (name, tensor, error)
    assert all(result["boxes_ok"] for result in tied_runs[name])


@pytest.mark.parametrize("config,layout,message", [
    (replace(CONFIG, seq_len=16), "encoder:dp=2;llm:cp=2", r"context parallelism .* cp=2: 17 \+ seq 16 = 33 is not "
                                                           r"a multiple of 2"),
    (replace(CONFIG, seq_len=17, sequence_parallel=True), "encoder:dp=4;llm:tp=2,cp=2",
     r"sequence parallelism splits each of the cp=2 chunks .* 17 \+ seq 17 = 34 is not a multiple of 4"),
    (CONFIG, "encoder:cp=2;llm:cp=2", r"encoder: cp=2; the encoder attends over each image's tokens whole"),
])
def test_a_sequence_cp_cannot_split_is_refused_with_the_rule(config, layout, message) -> None:
    with pytest.raises(TrainingError, match=message):
        check_hetero_trainable(config, place(get_model(CONFIG.model), layout))
    check_hetero_trainable(CONFIG, place(get_model(CONFIG.model), "encoder:dp=2;llm:cp=2"))
