"""Interleaved pipelines (vpp > 1) in the heterogeneous trainer's LLM (tiny-vlm: 4 LLM
layers, pp=2 x vpp=2 = 4 chunks of one layer; chunk c on pipeline rank c % pp, the
planner's cut), with torch's ScheduleInterleaved1F1B over each rank's virtual stages. The
first chunk (on pipeline rank 0, where the boundary delivers the image tokens) puts them
before the text; the last chunk (on rank pp-1) drops their positions before the head.

Oracles: a 1-rank run of the same config, and the same LLM layout with vpp=1 (1F1B over
pp=2). The interleaved schedule changes only the order in which micro-batches and layers
run; the maths is the same, so the runs must match within the layout noise test_hetero.py
defines (losses: 3 x max(noise, 1e-3), with noise the 1-rank vs homogeneous dp=2
difference; gradients through Adam's first moment after one step: per tensor, the largest
deviation relative to the tensor's largest entry within 3 x max(homogeneous deviation,
0.02)). The encoder's gradients come only through the image-token gradient the first
chunk returns through the boundary, so a chunk that lost the image tokens, a head on the
wrong chunk or a layer run twice is O(1) off on most tensors. Every run also hands its
state over after the first step and adopts it in a new trainer; test_hetero_switch.py's
"interleaved" schedule switches into a vpp layout and out of it.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.placement import layer_stages, place
from parallelism.training.hetero import check_hetero_trainable
from parallelism.training.image_text_stage import ImageTextStage
from parallelism.training.model import build_training_model
from parallelism.training.parallel import TrainConfig, TrainingError
from tests.support.hetero_parity import check_gradient_parity, check_loss_parity, run_layouts

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

CONFIG = TrainConfig(model="tiny-vlm", global_batch=8, seq_len=15, micro_batches=4, lr=3e-3)
STEPS = 3
# name: (layout, world, config, the vpp=1 run of the same LLM layout)
VPP_RUNS = {
    "vpp": ("encoder:dp=4;llm:tp=2,pp=2,vpp=2", 4, CONFIG, "pp2"),
    "vpp-non-colocated": ("encoder:dp=2,ranks=0-1;llm:pp=2,vpp=2,ranks=2-3", 4, CONFIG, None),
    # sequence parallelism too: 17 image + 15 text = 32 positions over tp=2 between the chunks
    "vpp-sp": ("encoder:dp=4;llm:tp=2,pp=2,vpp=2", 4, replace(CONFIG, sequence_parallel=True), "pp2"),
    # zero=3 (FSDP2) in both modules: each chunk an FSDP root (the decoder trainer's rule)
    "vpp-zero3": ("encoder:dp=4,zero=3;llm:tp=2,pp=2,vpp=2,zero=3", 4, CONFIG, "pp2"),
}
PLAIN_RUNS = {"single": ("tp=1", 1), "homogeneous": ("dp=2", 2), "pp2": ("encoder:dp=4;llm:tp=2,pp=2", 4)}


@pytest.fixture(scope="module")
def runs() -> dict:
    return run_layouts({**{name: (layout, world, CONFIG) for name, (layout, world) in PLAIN_RUNS.items()},
                        **{name: (layout, world, config) for name, (layout, world, config, _) in VPP_RUNS.items()}},
                       STEPS)


def _references(name: str) -> list[str]:
    return ["single"] + ([VPP_RUNS[name][3]] if VPP_RUNS[name][3] else [])


@pytest.mark.parametrize("name", list(VPP_RUNS))
def test_interleaved_losses_match_a_single_rank_and_the_plain_pipeline(runs, name) -> None:
    check_loss_parity(runs, name, _references(name))


@pytest.mark.parametrize("name", list(VPP_RUNS))
def test_interleaved_gradients_match_a_single_rank_and_the_plain_pipeline(runs, name) -> None:
    check_gradient_parity(runs, name, _references(name), CONFIG.model)


@pytest.mark.parametrize("name", list(VPP_RUNS))
def test_each_rank_runs_its_planned_chunks_and_hands_over_the_planners_boxes(runs, name) -> None:
    layout, world, _, _ = VPP_RUNS[name]
    llm = place(get_model(CONFIG.model), layout).modules["llm"]
    for rank, result in enumerate(runs[name]):
        assert result["boxes_ok"], (name, rank)
        if llm.offset <= rank < llm.offset + llm.world:
            pp_rank = (rank - llm.offset) // (llm.dp * llm.tp)
            assert result["chunks"] == [pp_rank + k * llm.pp for k in range(llm.vpp)], (name, rank)
        else:
            assert result["chunks"] == []


def test_the_chunks_cut_the_image_text_stage_as_the_planner_does() -> None:
    """Chunk 0 embeds the text (and takes the image tokens), the last chunk holds the final
    norm and head; every chunk's layers are the planner's for its pipeline rank; the whole
    stage refuses to run an interleaved rank's layers at once."""
    model = build_training_model(get_config(CONFIG.model), device="meta")
    pp, vpp = 2, 2
    cut = layer_stages(4, pp * vpp)
    seen = []
    for rank in range(pp):
        stage = ImageTextStage(model, rank, pp, sequence_shards=2, virtual=vpp)
        assert sorted(int(i) for i in stage.llm.layers) == [i for i, s in enumerate(layer_stages(4, pp, vpp))
                                                            if s == rank]
        for k in range(vpp):
            index = rank + k * pp
            part = stage.chunk(index)
            assert isinstance(part, ImageTextStage) and part.image_tokens == stage.image_tokens
            assert [int(i) for i in part.llm.layers] == [i for i, c in enumerate(cut) if c == index]
            assert (part.llm.embed is not None, part.llm.seq_scatter is not None) == (index == 0, index == 0)
            assert (part.llm.head is not None, part.llm.seq_gather is not None) == (index == 3, index == 3)
            seen += [int(i) for i in part.llm.layers]
        with pytest.raises(RuntimeError, match="virtual stages"):
            stage(torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 17, 64))
    assert sorted(seen) == [0, 1, 2, 3]


def test_an_interleaved_schedule_torch_cannot_run_is_refused_with_the_rule() -> None:
    model = get_model(CONFIG.model)
    with pytest.raises(TrainingError, match=r"llm: vpp=2: .* micro-batches must be a multiple of 2"):
        check_hetero_trainable(replace(CONFIG, micro_batches=5, global_batch=5),
                               place(model, "encoder:dp=4;llm:tp=2,pp=2,vpp=2"))
    check_hetero_trainable(CONFIG, place(model, "encoder:dp=4;llm:tp=2,pp=2,vpp=2"))

