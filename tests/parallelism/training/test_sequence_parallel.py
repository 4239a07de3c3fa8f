"""Sequence parallelism in the trainer (Megatron-style, DTensor's SequenceParallel plan).

SP changes where the norms run (on T/tp positions) and turns each TP all-reduce into a
reduce-scatter + all-gather; the maths is the same. So the first step's gradients
(exp_avg = (1 - beta1) * grad) under tp=2 with SP equal the single-rank run's up to bf16
rounding, as plain TP's do, and losses track the plain-TP run's within the same bf16
noise: the sum order of the reductions differs, nothing else.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import LocalShard
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.layout.shards import b_dim
from parallelism.training.parallel import ParallelTrainer, TrainConfig, TrainingError, check_trainable, initial_shards
from tests.support.tiny_models import write_tiny_gpt2_style

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(300)]

CONFIG = TrainConfig(model="tiny-gpt", global_batch=8, seq_len=16, micro_batches=2, lr=3e-3)
SP = dataclasses.replace(CONFIG, sequence_parallel=True)


def _moments_and_losses(rank: int, world: int, config: TrainConfig, layout: str, steps: int) -> dict:
    placement = place(get_model(config.model), layout)
    trainer = ParallelTrainer(config, layout, rank, initial_shards(placement, rank, config.seed))
    losses = [trainer.step().loss]
    shards, _ = trainer.hand_over()
    moments = {(k[0], s.box): s.data.float().numpy() for k, s in shards.items() if k[1] == "exp_avg"}
    trainer = ParallelTrainer(config, layout, rank, shards)
    losses += [trainer.step().loss for _ in range(steps - 1)]
    return {"moments": moments, "losses": losses}


def _whole_box(tensor) -> tuple[int, int, int, int]:
    bd = b_dim(tensor)
    return (0, tensor.shape[0], 0, tensor.shape[bd] if bd is not None else 0)


@pytest.fixture(scope="module")
def tiny_gpt2_style(tmp_path_factory) -> str:
    return write_tiny_gpt2_style(tmp_path_factory.mktemp("gpt2-style"))


@pytest.mark.parametrize("layout,world,style", [("tp=2", 2, "llama"), ("tp=2,pp=2", 4, "llama"), ("tp=2", 2, "gpt")])
def test_sequence_parallel_gradients_match_a_single_rank(layout, world, style, request) -> None:
    # gpt style: the first stage adds learned positions to the whole sequence, then splits it
    # over tp; the position table's gradient comes back whole through the split's all-gather.
    model = request.getfixturevalue("tiny_gpt2_style") if style == "gpt" else CONFIG.model
    config, sp = dataclasses.replace(CONFIG, model=model), dataclasses.replace(SP, model=model)
    single = run_ranks(1, _moments_and_losses, config, "tp=1", 1, timeout_s=120)[0]
    full = {index: value for (index, _), value in single["moments"].items()}
    spec = get_model(model)
    results = run_ranks(world, _moments_and_losses, sp, layout, 1, timeout_s=180)
    # A gradient that is zero in exact arithmetic (a key bias: softmax ignores a per-query
    # constant) is rounding noise on both sides; it is judged against the model's gradient
    # scale (1e-4 of the largest moment) rather than against itself.
    floor = 1e-4 * max(abs(v).max() for v in full.values())
    checked = set()
    for result in results:
        for (index, box), value in result["moments"].items():
            region = LocalShard(spec.tensors[index], "exp_avg", _whole_box(spec.tensors[index]),
                                torch.from_numpy(full[index])).region(box).numpy()
            scale = max(abs(region).max(), floor)
            assert abs(value - region).max() / scale < 0.05, spec.tensors[index].name
            checked.add(index)
    assert checked == set(range(len(spec.tensors)))  # every tensor's gradient, norms included
    assert abs(results[0]["losses"][0] - single["losses"][0]) < 1e-2


def test_sequence_parallel_trains_like_plain_tensor_parallelism() -> None:
    plain = run_ranks(2, _moments_and_losses, CONFIG, "tp=2", 4, timeout_s=120)[0]["losses"]
    sp = run_ranks(2, _moments_and_losses, SP, "tp=2", 4, timeout_s=120)[0]["losses"]
    noise = abs(plain[0] - run_ranks(1, _moments_and_losses, CONFIG, "tp=1", 1, timeout_s=120)[0]["losses"][0])
    assert all(abs(a - b) <= max(4 * noise, 2e-3) for a, b in zip(plain, sp)), (plain, sp, noise)


@pytest.mark.parametrize("config,layout,message", [
    (dataclasses.replace(SP, seq_len=15), "tp=2", "seq 15 is not a multiple of 2"),
])
def test_sequence_parallel_refuses_what_it_cannot_split(config, layout, message) -> None:
    with pytest.raises(TrainingError, match=message):
        check_trainable(config, place(get_model(config.model), layout))
