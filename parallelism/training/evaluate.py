"""Validation loss of a live trainer: the mean next-token loss over the first `batches` global
batches of its dataset's validation split (the same held-out samples at every evaluation, so the
curve is comparable across steps and across layouts). Forward only, no state changes: each data
rank evaluates its slice of each batch in the training micro-batches (a pipeline runs its
schedule's `eval`), and the sums meet in one all-reduce over the layout's ranks."""
from __future__ import annotations

import torch
import torch.distributed as dist

from parallelism.training.context_parallel import split_sequence
from parallelism.training.data import training_data


def evaluate(trainer, batches: int) -> float | None:
    """The global mean validation loss (every rank of the layout returns it); None off the layout."""
    if not trainer.active:
        return None
    if batches < 1:
        raise ValueError(f"evaluate {batches} batches: need at least one")
    config, ml = trainer.config, trainer.ml
    data = training_data(config, "validation")
    per_dp = config.global_batch // ml.dp
    micro = config.micro_batches
    total = torch.zeros(1, dtype=torch.float64)
    with torch.no_grad():
        for b in range(batches):
            tokens, targets = data.batch(b * config.global_batch + trainer.dp_rank * per_dp, per_dp)
            if trainer.context is not None:
                tokens, targets = split_sequence(tokens, targets, trainer.context)
            total += _batch_loss(trainer, tokens, targets, micro)
    if not (trainer.pp_rank == ml.pp - 1 and trainer.tp_rank == 0):
        total.zero_()  # one contribution per data index, as the training loss
    total = total.to(tokens.device)
    dist.all_reduce(total, group=trainer.meshes.everyone)
    return float(total.item()) / (batches * micro * ml.dp * ml.cp)


def _batch_loss(trainer, tokens, targets, micro: int) -> float:
    """Sum over this rank's micro-batches of their mean loss (the last stage's; 0 elsewhere)."""
    from parallelism.training.parallel import cross_entropy_loss

    if trainer.pipeline is None:
        return sum(float(cross_entropy_loss(trainer.stage(x), y)) for x, y in zip(tokens.chunk(micro),
                                                                                targets.chunk(micro)))
    losses: list = []
    if trainer.pp_rank == 0:
        trainer.pipeline.eval(tokens)
    elif trainer.pp_rank == trainer.ml.pp - 1:
        trainer.pipeline.eval(target=targets, losses=losses)
    else:
        trainer.pipeline.eval()
    return sum(float(v) for v in losses) * micro  # the schedule's loss_fn divides by the micro-batches
