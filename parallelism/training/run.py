"""Training with online layout switches, one process per rank (what `dynaplane train` runs).

Every process of the union world (the largest layout's size) runs `train_rank`: ranks
outside the current layout wait at the next switch. At a switch step, at the step
boundary: the trainer hands over its shards, the scalars (step, data position, RNG) go
from rank 0 to everyone, every rank plans the same transition and checks fingerprints,
the engine moves the state, a layout-independent digest of every logical tensor is
compared before and after (any difference fails the switch and names the tensor), and a
trainer for the new layout adopts the new shards.
"""
from __future__ import annotations

from dataclasses import dataclass, field


from parallelism.engine.shards import Key, LocalShard
from parallelism.engine.switch import SwitchReport, switch_state
from parallelism.layout.placement import place
from parallelism.training.hetero import HeteroTrainer, check_hetero_trainable
from parallelism.training.loop import first_shards, run_loop
from parallelism.training.parallel import (ParallelTrainer, StepResult, TrainConfig, TrainingError, TrainScalars,
                                           check_trainable)


@dataclass(frozen=True)
class Switch:
    step: int      # switch before this step runs (after `step` steps in the old layout)
    layout: str


@dataclass(frozen=True)
class EvalResult:
    step: int          # evaluated after this many steps
    loss: float        # mean validation loss (nats per token)
    bytes_per_token: float | None = None  # the dataset's text bytes per token, when known (bits per byte)


@dataclass
class RankLog:
    steps: list[StepResult] = field(default_factory=list)
    switches: list[SwitchReport] = field(default_factory=list)
    evals: list[EvalResult] = field(default_factory=list)


def parse_switch(text: str) -> Switch:
    """'STEP:LAYOUT', e.g. '20:tp=2,pp=1,dp=2,zero=1'."""
    step, sep, layout = text.partition(":")
    if not sep or not step.strip().isdigit() or not layout.strip():
        raise TrainingError(f"--switch {text!r}: expected STEP:LAYOUT, e.g. 20:tp=2,pp=1,dp=2,zero=1")
    return Switch(int(step), layout.strip())


def union_world(config: TrainConfig, layout: str, switches: list[Switch]) -> int:
    spec = config.tensors
    return max(place(spec, lay).world for lay in [layout, *(s.layout for s in switches)])


def check_schedule(steps: int, switches: list[Switch]) -> None:
    last = 0
    for s in switches:
        if not 0 < s.step < steps or s.step <= last:
            raise TrainingError(f"switch at step {s.step}: switch steps must increase and lie in 1..{steps - 1}")
        last = s.step


def check_layout(config: TrainConfig, layout: str) -> None:
    """Raise TrainingError (or LayoutError) naming why the model's trainer cannot train
    `layout`: checked for every layout of a schedule before any rank starts, so a switch is
    never refused after the state has left the old layout."""
    placement = place(config.tensors, layout)
    if config.model_config.encoder is not None:
        check_hetero_trainable(config, placement)
    else:
        check_trainable(config, placement)


def build_trainer(config: TrainConfig, layout: str, rank: int, shards: dict[Key, LocalShard],
                  scalars: TrainScalars | None, *, meshes=None) -> ParallelTrainer | HeteroTrainer:
    """The trainer for the model: HeteroTrainer (a layout per module, issue 8) for models
    with an encoder, whatever the layout string (a plain one gives both modules the same
    layout), else ParallelTrainer. Collective: every rank of the default group calls it,
    unless `meshes` (the `meshes` of a trainer of the same layout) are given."""
    if config.model_config.encoder is not None:
        return HeteroTrainer(config, layout, rank, shards, scalars, meshes=meshes)
    return ParallelTrainer(config, layout, rank, shards, scalars, meshes=meshes)


def switch_trainer(trainer: ParallelTrainer | HeteroTrainer, layout: str,
                   **options) -> tuple[ParallelTrainer | HeteroTrainer, SwitchReport]:
    """Hand a live trainer's state over to a trainer for `layout`, at a step boundary. For a
    multimodal model the plan moves each module's tensors from that module's old layout and
    ranks to its new ones (homogeneous, colocated and non-colocated alike)."""
    src = str(trainer.placement.layout)
    shards, scalars = trainer.hand_over()
    new, scalars, report = switch_state(trainer.spec, shards, scalars, src, layout, trainer.rank, **options)
    return build_trainer(trainer.config, layout, trainer.rank, new, scalars), report


class _Schedule:
    """The CLI's rounds (loop.Rounds): the log, the progress callback, the scheduled switches and the
    step count; the trainer it ends with."""

    def __init__(self, steps: int, switches: list[Switch], staging_bytes: int, on_step, rank: int) -> None:
        self.steps, self.pending, self.staging_bytes = steps, {s.step: s for s in switches}, staging_bytes
        self.on_step, self.rank, self.done, self.log, self.final = on_step, rank, 0, RankLog(), None

    def _tell(self, item) -> None:
        if self.on_step:
            self.on_step(self.rank, item)

    def stepped(self, trainer, result, validation) -> None:
        self.done += 1
        if result is not None:
            self.log.steps.append(result)
            self._tell(result)
        if validation is not None:
            self.log.evals.append(EvalResult(trainer.scalars.step, validation, trainer.data.manifest.bytes_per_token))
            self._tell(self.log.evals[-1])

    def failed(self, trainer, exc, step_before) -> None:
        pass  # the CLI has no recovery: the error ends the run

    def boundary(self, trainer):
        if self.done >= self.steps:
            self.final = trainer
            return None
        if self.done in self.pending:
            trainer, report = switch_trainer(trainer, self.pending[self.done].layout, staging_bytes=self.staging_bytes)
            self.log.switches.append(report)
            self._tell(report)
        return trainer


def train_rank(rank: int, world: int, config: TrainConfig, layout: str, steps: int, switches: list[Switch],
               staging_bytes: int = 64 * 2**20, on_step=None, eval_every: int = 0, eval_batches: int = 1,
               init_from: str | None = None, export: str | None = None) -> RankLog:
    """The whole run on one rank, through the loop the agents' ranks run (loop.py);
    `on_step(rank, StepResult | SwitchReport | EvalResult)` sees progress.
    eval_every > 0: the validation loss after every eval_every steps (parallelism/training/evaluate.py).
    init_from: a Hugging Face model directory the weights start from (each rank reads its boxes);
    export: a directory the final weights go to as a Hugging Face model (collective, at the end)."""
    check_schedule(steps, switches)
    for text in [layout, *(s.layout for s in switches)]:
        check_layout(config, text)
    shards = first_shards(place(config.tensors, layout), rank, config.seed, init_from)
    trainer = build_trainer(config, layout, rank, shards, TrainScalars())
    del shards
    schedule = _Schedule(steps, switches, staging_bytes, on_step, rank)
    if steps > 0:
        run_loop(trainer, schedule, eval_every=eval_every, eval_batches=eval_batches)
        trainer = schedule.final
    if export:
        from parallelism.hf_weights.export import export_hf_from_shards

        final, _ = trainer.hand_over()
        export_hf_from_shards(trainer.placement, rank, final, export, config=config.model_config,
                              source_dir=init_from)
    return schedule.log
