"""The switch test every trainer parallelism gets (tied heads, replicated kv heads,
interleaved pipelines, ...): train on `start` with online switches at the schedule's steps,
each one bit-exact against the checkpoint path and verified, beside an unswitched run of
`start` and a single-rank run that gives the layout noise; the switched run's losses stay
within (switches + 1) x that noise of the unswitched one, and the model learns."""
from __future__ import annotations

from parallelism.engine.launch import run_ranks
from parallelism.layout.placement import place
from parallelism.training.parallel import ParallelTrainer, TrainConfig, initial_shards
from parallelism.training.run import Switch, train_rank
from tests.support.first_step import switch_against_the_checkpoint_path


def switched_run(rank: int, world: int, config: TrainConfig, start: str, switches: list[Switch], steps: int,
                 folder: str, final=None) -> dict:
    """One rank's run; `final(spec, shards)` adds what the test wants of the last state."""
    spec = config.tensors
    layout = start
    trainer = ParallelTrainer(config, layout, rank, initial_shards(place(spec, layout), rank, config.seed))
    pending = {s.step: s.layout for s in switches}
    losses, reports = [], []
    for step in range(steps):
        if step in pending:
            shards, scalars = trainer.hand_over()
            new, scalars, report = switch_against_the_checkpoint_path(spec, shards, scalars, layout, pending[step],
                                                                      rank, f"{folder}/step{step}")
            reports.append(report.verified)
            layout = pending[step]
            trainer = ParallelTrainer(config, layout, rank, new, scalars)
        result = trainer.step()
        losses.append(None if result is None else result.loss)
    out = {"losses": losses, "reports": reports}
    if final is not None:
        out["final"] = final(spec, trainer.hand_over()[0])
    return out


def plain_losses(rank: int, world: int, config: TrainConfig, layout: str, steps: int) -> list[float]:
    return [s.loss for s in train_rank(rank, world, config, layout, steps, []).steps]


def check_switched_training(config: TrainConfig, start: str, switches: list[Switch], steps: int, folder: str,
                            world: int = 4, final=None) -> list[dict]:
    """Run and check as the module doc says; returns every rank's switched run."""
    switched = run_ranks(world, switched_run, config, start, switches, steps, folder, final, timeout_s=280)
    unswitched = run_ranks(world, plain_losses, config, start, steps, timeout_s=200)[0]
    other_layout = run_ranks(1, plain_losses, config, "tp=1,pp=1,dp=1,zero=0", steps, timeout_s=120)[0]
    assert all(all(r["reports"]) and len(r["reports"]) == len(switches) for r in switched)
    losses = switched[0]["losses"]
    first = switches[0].step
    assert losses[:first] == unswitched[:first]  # before the first switch: the same program
    noise = max(abs(a - b) for a, b in zip(unswitched, other_layout))
    assert 0 < noise < 5e-3, noise
    for step, (a, b) in enumerate(zip(losses, unswitched)):
        assert abs(a - b) <= (len(switches) + 1) * noise, (step, a, b, noise)
    assert losses[-1] < losses[0] - 0.05  # and it learns
    return switched
