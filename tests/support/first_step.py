"""Oracles for the parallel trainer. The single-rank oracle of its gradients: after one step Adam's first
moment is (1 - beta1) x the gradient, so every rank's box of it must equal the same box of a
single-rank run (up to bf16 rounding; a wrong shard is off by O(1))."""
from __future__ import annotations

import torch

from parallelism.engine.checkpoint import checkpoint_switch
from parallelism.engine.launch import run_ranks
from parallelism.engine.shards import LocalShard
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.layout.shards import b_dim
from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards


def first_step_moments(rank: int, world: int, config: TrainConfig, layout: str) -> dict:
    """{(tensor index, box): exp_avg} of this rank after one step (run_ranks' fn)."""
    placement = place(get_model(config.model), layout)
    trainer = ParallelTrainer(config, layout, rank, initial_shards(placement, rank, config.seed))
    trainer.step()
    shards, _ = trainer.hand_over()
    return {(k[0], s.box): s.data.float().numpy() for k, s in shards.items() if k[1] == "exp_avg"}


def whole_box(tensor) -> tuple[int, int, int, int]:
    bd = b_dim(tensor)
    return (0, tensor.shape[0], 0, tensor.shape[bd] if bd is not None else 0)


def boxes_off_the_single_rank(config: TrainConfig, layout: str, world: int) -> tuple[list[str], list[int]]:
    """(names of the boxes whose first moment is off the single-rank run's by more than 5%,
    the tensor index of every box checked)."""
    single = run_ranks(1, first_step_moments, config, "tp=1,pp=1,dp=1,zero=0", timeout_s=120)[0]
    return boxes_off(config, single, run_ranks(world, first_step_moments, config, layout, timeout_s=200))


def boxes_off(config: TrainConfig, single: dict, ranks: list[dict], floor: float = 0.0) -> tuple[list[str], list[int]]:
    """boxes_off_the_single_rank's comparison of every rank's first moments with the single run's.
    `floor` (a fraction of the largest moment): a gradient that is zero in exact arithmetic
    (a key bias: softmax ignores a per-query constant) is rounding noise on both sides and is
    judged against the model's gradient scale instead of against itself."""
    full = {index: value for (index, _), value in single.items()}
    scale_floor = floor * max(abs(v).max() for v in full.values())
    spec = get_model(config.model)
    off, checked = [], []
    for rank_moments in ranks:
        for (index, box), value in rank_moments.items():
            tensor = spec.tensors[index]
            region = LocalShard(tensor, "exp_avg", whole_box(tensor), torch.from_numpy(full[index])).region(box).numpy()
            if abs(value - region).max() / (max(abs(region).max(), scale_floor) + 1e-12) >= 0.05:
                off.append(f"{tensor.name} {box}")
            checked.append(index)
    return off, checked


def switch_against_the_checkpoint_path(spec, shards: dict, scalars, src: str, dst: str, rank: int, folder: str):
    """Switch handed-over `shards` from layout src to dst with the engine and assert every
    new shard equals, bit for bit, what torch.distributed.checkpoint loads into dst from a
    checkpoint of src (the oracle). Returns switch_state's (new shards, scalars, report)."""
    from parallelism.training.run import switch_state

    reference = checkpoint_switch(place(spec, src), place(spec, dst), rank, shards, folder)
    new, scalars, report = switch_state(spec, shards, scalars, src, dst, rank, staging_bytes=256 * 1024)
    assert set(new) == set(reference)
    for key in reference:
        assert torch.equal(new[key].data, reference[key].data), (spec.tensors[key[0]].name, key[1], rank)
    return new, scalars, report
