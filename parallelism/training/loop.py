"""The training loop every rank runs, in `dynaplane train` (run.py) and in an agent's rank process
(agents/runtime/train_loop.py): a step, the validation loss when it is due, what the caller does
with them, then the step boundary, where the caller checkpoints, switches or stops. The weights a
run starts from (`first_shards`: a Hugging Face model or the seeded init) are chosen here too, so
the CLI loads, trains and evaluates as the product does, and measures what the product runs."""
from __future__ import annotations

from typing import Protocol


class Rounds(Protocol):
    """What a caller does around the loop's steps."""

    def stepped(self, trainer, result, validation: float | None) -> None:
        """A step ran (`result` is None on a rank outside the layout) and, when due, the validation
        loss after it (None off the layout or when not due)."""

    def failed(self, trainer, exc: RuntimeError, step_before: int) -> None:
        """The step raised; the loop re-raises `exc` after this (which may raise another error)."""

    def boundary(self, trainer):
        """At the step boundary: the trainer to go on with (this one, or a new layout's), or None
        to end the loop."""


def first_shards(placement, rank: int, seed: int, init_from: str | None = None) -> dict:
    """This rank's starting state: its boxes of a Hugging Face model directory (each rank reads
    only what it holds) when `init_from`, else of the seeded initialisation; nothing beyond the
    layout's world."""
    if rank >= placement.world:
        return {}
    if init_from:
        from parallelism.hf_weights import hf_initial_shards

        return hf_initial_shards(placement, rank, init_from)
    from parallelism.training.parallel import initial_shards

    return initial_shards(placement, rank, seed)


def evaluation_due(eval_every: int, step: int) -> bool:
    """Whether the validation loss follows the step that brought the state to `step`."""
    return eval_every > 0 and step > 0 and step % eval_every == 0


def run_loop(trainer, rounds: Rounds, *, eval_every: int = 0, eval_batches: int = 1) -> int:
    """Steps until `rounds.boundary` ends the loop; returns the steps run. The validation loss is
    collective over the layout's ranks, which reach the same step together."""
    from parallelism.training.evaluate import evaluate

    steps = 0
    while True:
        step_before = trainer.scalars.step
        try:
            result = trainer.step()
        except RuntimeError as exc:
            rounds.failed(trainer, exc, step_before)
            raise
        validation = None
        if trainer.active and evaluation_due(eval_every, trainer.scalars.step):
            validation = evaluate(trainer, eval_batches)
        steps += 1
        rounds.stepped(trainer, result, validation)
        trainer = rounds.boundary(trainer)
        if trainer is None:
            return steps
