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
import torch

from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import LocalShard
from parallelism.layout.catalog import get_config, get_model
from parallelism.layout.placement import place
from parallelism.layout.shards import b_dim
from parallelism.training.hetero import HeteroTrainer, check_hetero_trainable
from parallelism.training.image_text_stage import ImageTextStage
from parallelism.training.parallel import TrainConfig, TrainingError, initial_shards

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


def _run(rank: int, world: int, config: TrainConfig, layout: str) -> dict:
    placement = place(get_model(config.model), layout)
    shards = initial_shards(placement, rank, config.seed) if rank < placement.world else {}
    trainer = HeteroTrainer(config, layout, rank, shards)
    losses = [trainer.step()]
    shards, scalars = trainer.hand_over()
    moments = {(k[0], s.box): s.data.float().numpy().copy() for k, s in shards.items() if k[1] == "exp_avg"}
    trainer = HeteroTrainer(config, layout, rank, shards, scalars)
    losses += [trainer.step() for _ in range(STEPS - 1)]
    return {"losses": [None if r is None else r.loss for r in losses], "moments": moments}


@pytest.fixture(scope="module")
def runs() -> dict:
    out = {name: run_ranks(world, _run, CONFIG, layout, timeout_s=300) for name, (layout, world) in PLAIN_RUNS.items()}
    out.update({name: run_ranks(world, _run, SP, layout, timeout_s=300) for name, (layout, world, _) in SP_RUNS.items()})
    return out


def _whole(tensor, value: torch.Tensor) -> LocalShard:
    bd = b_dim(tensor)
    return LocalShard(tensor, "exp_avg", (0, tensor.shape[0], 0, tensor.shape[bd] if bd is not None else 0), value)


def _full_moments(run: list[dict]) -> dict[int, torch.Tensor]:
    """A run's exp_avg tensors assembled from every rank's boxes (replicas must agree)."""
    spec = get_model(CONFIG.model)
    full: dict[int, torch.Tensor] = {}
    for rank_result in run:
        for (index, box), value in rank_result["moments"].items():
            tensor = spec.tensors[index]
            whole = full.setdefault(index, torch.full(tensor.shape, float("nan")))
            shard = _whole(tensor, whole)
            region = shard.region(box)
            region.copy_(torch.from_numpy(value))  # region is a view of `whole`
    for index, whole in full.items():
        assert not whole.isnan().any(), spec.tensors[index].name
    return full


def _errors(run: list[dict], reference: list[dict]) -> dict[str, float]:
    """Per tensor: the largest |exp_avg - reference's| over every rank's box, relative to
    the reference tensor's largest entry."""
    spec = get_model(CONFIG.model)
    full = _full_moments(reference)
    errors: dict[str, float] = {}
    for rank_moments in run:
        for (index, box), value in rank_moments["moments"].items():
            tensor = spec.tensors[index]
            region = _whole(tensor, full[index]).region(box)
            scale = float(full[index].abs().max()) + 1e-12
            errors[tensor.name] = max(errors.get(tensor.name, 0.0),
                                      float((torch.from_numpy(value) - region).abs().max()) / scale)
    return errors


def _loss_bound(runs) -> tuple[float, float]:
    noise = max(abs(a - b) for a, b in zip(runs["single"][0]["losses"], runs["homogeneous"][0]["losses"]))
    return noise, 3 * max(noise, 1e-3)


@pytest.mark.parametrize("name", list(SP_RUNS))
def test_sequence_parallel_losses_match_a_single_rank_and_the_plain_layout(runs, name) -> None:
    noise, allowed = _loss_bound(runs)
    losses = runs[name][0]["losses"]
    for rank_result in runs[name]:
        assert rank_result["losses"] == losses  # every rank reports the global loss
    references = ["single"] + ([SP_RUNS[name][2]] if SP_RUNS[name][2] else [])
    for reference in references:
        for step, (a, b) in enumerate(zip(losses, runs[reference][0]["losses"])):
            assert abs(a - b) <= allowed, (name, reference, step, a, b, noise)
    print(name, "noise", f"{noise:.2e}", {r: max(abs(a - b) for a, b in zip(losses, runs[r][0]["losses"]))
                                         for r in references})


@pytest.mark.parametrize("name", list(SP_RUNS))
def test_sequence_parallel_gradients_match_a_single_rank_and_the_plain_layout(runs, name) -> None:
    spec = get_model(CONFIG.model)
    noise = _errors(runs["homogeneous"], runs["single"])
    references = ["single"] + ([SP_RUNS[name][2]] if SP_RUNS[name][2] else [])
    for reference in references:
        errors = _errors(runs[name], runs[reference])
        assert set(errors) == {t.name for t in spec.tensors}  # every tensor of both modules checked
        worst = sorted(errors, key=lambda t: errors[t] / max(noise[t], 0.02))[-3:]
        print(name, "vs", reference, {t: (round(errors[t], 4), round(noise[t], 4)) for t in worst})
        for tensor, error in errors.items():
            assert error <= 3 * max(noise[tensor], 0.02), (name, reference, tensor, error, noise[tensor])


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
