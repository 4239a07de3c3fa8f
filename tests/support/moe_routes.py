"""The single-rank oracle for MoE layers (tests/support/first_step.py's, routed alike).

Top-k routing is a discrete function of bf16 values: a layout's rounding noise (the TP
all-reduce, another reduction order) flips the choice of a token whose k-th and (k+1)-th
experts are nearly tied, which moves that token's O(1) contribution to another expert (tiny-moe
under tp=2 flips 1-2 of its 64 tokens in some layers). So the oracle routes as the parallel
run did: every rank records each MoE layer's chosen experts by (sample, position); the
single-rank run takes those choices, its gates still its own router's probabilities at them
(MoE.route's formula), and every rank's first Adam moment must match the single run's box.
The TP ranks of a parallel run must have routed identically (checked when merging).
"""
from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from parallelism.engine.launch import run_ranks
from parallelism.layout.catalog import get_model
from parallelism.layout.placement import place
from parallelism.training.moe import MoE
from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards
from tests.support.first_step import boxes_off

Routes = dict[tuple[str, int, int], tuple[int, ...]]  # (MoE layer, sample, position) -> chosen experts


def _routed(trainer: ParallelTrainer, config: TrainConfig, forced: Routes | None, record: Routes) -> None:
    """Make every MoE layer of the trainer record its routing into `record`, or take `forced`'s."""
    per_dp = config.global_batch // trainer.ml.dp
    micro = per_dp // config.micro_batches
    for name, moe in trainer.stage.named_modules():
        if not isinstance(moe, MoE):
            continue

        # With pp > 1 torch's pipeline stage first runs its forward once to infer shapes (on
        # the first micro-batch, or an uninitialized tensor past the first stage): not a step's.
        calls = itertools.count(-1 if trainer.pipeline is not None else 0)

        def route(flat, moe=moe, name=name, calls=calls):
            call = next(calls)
            if call < 0:
                return MoE.route(moe, flat)
            first = trainer.dp_rank * per_dp + call * micro  # micro-batches run in order on a stage
            seq = flat.shape[0] // micro  # the rank's chunk of the sequence under context parallelism
            start = trainer.cp_rank * seq
            keys = [(name, first + i // seq, start + i % seq) for i in range(flat.shape[0])]
            probs = F.softmax(moe.router(flat).float(), dim=-1)
            if forced is None:
                top, chosen = probs.topk(moe.top_k, dim=-1)
                record.update(zip(keys, map(tuple, chosen.tolist())))
            else:
                chosen = torch.tensor([forced[k] for k in keys], dtype=torch.long)
                top = probs.gather(1, chosen)
            return (top / top.sum(-1, keepdim=True)).to(flat.dtype), chosen

        moe.route = route


def routed_first_step(rank: int, world: int, config: TrainConfig, layout: str, forced: Routes | None):
    """(first moments as first_step_moments gives them, the routes taken) of this rank."""
    placement = place(get_model(config.model), layout)
    trainer = ParallelTrainer(config, layout, rank, initial_shards(placement, rank, config.seed))
    record: Routes = {}
    if trainer.active:
        _routed(trainer, config, forced, record)
    trainer.step()
    shards, _ = trainer.hand_over()
    return {(k[0], s.box): s.data.float().numpy() for k, s in shards.items() if k[1] == "exp_avg"}, record


def merged(records: list[Routes]) -> Routes:
    out: Routes = {}
    for record in records:
        for key, chosen in record.items():
            assert out.setdefault(key, chosen) == chosen, f"ranks routed {key} differently: {out[key]} and {chosen}"
    return out


def moe_boxes_off_the_single_rank(config: TrainConfig, layout: str, world: int) -> tuple[list[str], list[int], int]:
    """first_step.boxes_off_the_single_rank with the single run routed as the parallel one;
    also the number of (layer, token) routes taken."""
    ranks = run_ranks(world, routed_first_step, config, layout, None, timeout_s=200)
    routes = merged([r[1] for r in ranks])
    single = run_ranks(1, routed_first_step, config, "tp=1,pp=1,dp=1,zero=0", routes, timeout_s=120)[0][0]
    off, checked = boxes_off(config, single, [r[0] for r in ranks])
    return off, checked, len(routes)
