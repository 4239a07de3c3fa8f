"""Interleaved pipelines (vpp > 1, issue 29) with torch.distributed.pipelining's
ScheduleInterleaved1F1B, on a model with an odd layer count (tiny-gpt-5l: 5 layers in
pp*vpp = 4 chunks of 2, 1, 1, 1), on real gloo process groups.

Each rank runs the virtual stages the planner gives it (chunk c on pipeline rank c % pp:
rank 0 layers 0-1 and 3, rank 1 layers 2 and 4), checked against the planner's own cut and
against a single-rank run (first-step Adam moments, as tests/support/first_step.py
explains). Then online switches pp=2,vpp=2,dp=2 <-> tp=2,pp=2 (and ZeRO-3 interleaved),
bit-exact against the checkpoint path, verified, with training going on as an
unswitched run does.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from parallelism.engine.launch import run_ranks
from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.placement import layer_stages, place
from parallelism.training.model import build_training_model
from parallelism.training.stage import DecoderStage
from parallelism.training.parallel import ParallelTrainer, TrainConfig, check_trainable, initial_shards
from parallelism.training.run import Switch
from tests.support.switched_training import check_switched_training
from tests.support.first_step import boxes_off_the_single_rank

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-gpt-5l", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
START = "pp=2,vpp=2,dp=2,zero=1"
SWITCHES = [Switch(2, "tp=2,pp=2,zero=1"), Switch(4, "pp=2,vpp=2,dp=2,zero=3"), Switch(6, START)]
STEPS = 8


@st.composite
def _cuts(draw):
    layers = draw(st.integers(2, 11))
    pp = draw(st.integers(2, min(4, layers)))
    return layers, pp, draw(st.integers(1, layers // pp)), draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(_cuts())
def test_virtual_stages_are_the_planners_chunks_in_pipeline_order(cut) -> None:
    """Whatever L, pp and vpp: rank r's chunks r, r+pp, ... hold exactly the rank's layers
    (placement.layer_stages), each chunk a contiguous run, the chunks in index order are
    layers 0..L-1 with the planner's sizes (the first L % (pp*vpp) one longer), and the
    embedding, final norm and head sit on the first and last chunk (the head's tied copy too)."""
    layers, pp, vpp, tied = cut
    config = get_config("tiny-gpt")
    config = replace(config, llm=replace(config.llm, layers=layers, tied=tied))
    model = build_training_model(config, device="meta")
    chunks = pp * vpp
    by_index = {}
    for rank in range(pp):
        stage = DecoderStage(model, rank, pp, virtual=vpp)
        held = sorted(int(i) for i in stage.llm.layers)
        assert held == [i for i, s in enumerate(layer_stages(layers, pp, vpp)) if s == rank]
        parts = [stage.chunk(rank + k * pp) for k in range(vpp)]
        assert sorted(int(i) for p in parts for i in p.llm.layers) == held
        for part in parts:
            by_index[part.index] = part
            assert {id(p) for p in part.parameters()} <= {id(p) for p in stage.parameters()}  # the rank's own modules
        with pytest.raises(ValueError, match="does not run on pipeline rank"):
            stage.chunk((rank + 1) % pp)
    order = [int(i) for c in range(chunks) for i in by_index[c].llm.layers]
    assert order == list(range(layers))
    base, extra = divmod(layers, chunks)
    assert [len(by_index[c].llm.layers) for c in range(chunks)] == [base + (c < extra) for c in range(chunks)]
    for c, part in by_index.items():
        assert (part.first, part.last) == (c == 0, c == chunks - 1)
        assert (part.llm.embed is not None) == (c == 0 or (tied and c == chunks - 1))
        assert (part.llm.final_norm is not None) == (c == chunks - 1)


def _virtual_stages(rank: int, world: int, layout: str) -> dict:
    placement = place(get_model(CONFIG.model), layout)
    trainer = ParallelTrainer(CONFIG, layout, rank, initial_shards(placement, rank, CONFIG.seed))
    if not trainer.active:
        return {}
    return {"pp_rank": trainer.pp_rank,
            "chunks": [(c.index, [int(i) for i in c.llm.layers]) for c in trainer.chunks],
            "ends": [(c.first, c.last) for c in trainer.chunks],
            "layers": sorted(int(i) for i in trainer.stage.llm.layers)}


def test_each_rank_runs_the_planners_virtual_stages() -> None:
    assert get_model(CONFIG.model).module("llm").num_layers % 2 == 1
    assert layer_stages(5, 2, 2) == (0, 0, 1, 0, 1)  # chunks [0,1] [2] [3] [4] on ranks 0, 1, 0, 1
    for r in run_ranks(2, _virtual_stages, "pp=2,vpp=2", timeout_s=120):
        chunks = [c for c, _ in r["chunks"]]
        assert chunks == [r["pp_rank"], r["pp_rank"] + 2]
        assert r["layers"] == [i for i, s in enumerate(layer_stages(5, 2, 2)) if s == r["pp_rank"]]
        assert [layers for _, layers in r["chunks"]] == ([[0, 1], [3]] if r["pp_rank"] == 0 else [[2], [4]])
        assert r["ends"] == ([(True, False), (False, False)] if r["pp_rank"] == 0 else [(False, False), (False, True)])


@pytest.mark.parametrize("layout,world", [("pp=2,vpp=2,dp=2,zero=1", 4), ("pp=2,vpp=2,dp=2,zero=3", 4),
                                          ("tp=2,pp=2,vpp=2,zero=0", 4)])
def test_gradients_match_a_single_rank(layout: str, world: int) -> None:
    off, checked = boxes_off_the_single_rank(CONFIG, layout, world)
    assert off == []
    assert set(checked) == set(range(len(get_model(CONFIG.model).tensors)))


def test_a_tied_model_keeps_its_tie_across_interleaved_end_stages() -> None:
    config = TrainConfig(model="tiny-gpt-tied", global_batch=8, seq_len=16, micro_batches=2)
    off, _ = boxes_off_the_single_rank(config, "pp=2,vpp=2,zero=1", 2)
    assert off == []


def test_micro_batches_the_interleaved_schedule_cannot_split_are_refused() -> None:
    config = TrainConfig(model=CONFIG.model, global_batch=10, micro_batches=5)
    with pytest.raises(ValueError, match="micro-batches must be a multiple of 2"):
        check_trainable(config, place(get_model(CONFIG.model), "pp=2,vpp=2"))


def test_switches_into_and_out_of_interleaved_pipelines_are_exact_verified_and_train_on(tmp_path) -> None:
    check_switched_training(CONFIG, START, SWITCHES, STEPS, str(tmp_path))
