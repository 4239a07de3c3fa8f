"""What every rank of a job trains with, and the trainer a rank builds for a layout."""
from __future__ import annotations

from dataclasses import dataclass

from agents.protocol import STEP_TIMEOUT_SECONDS
from parallelism.layout.model_request import ModelConfig, NamesAModel, resolved_field

# The LR schedule's length. Not max_steps: stopping a job early (or late) must not change
# what it trains on the steps it does run.
SCHEDULE_STEPS = 10_000


@dataclass(frozen=True)
class JobSettings(NamesAModel):
    """What every rank of a job trains with, whichever order told it."""

    job_id: int
    model: str
    global_batch: int
    micro_batch: int
    seq: int
    seed: int
    max_steps: int | None
    report_every: int
    timeout_seconds: float
    checkpoint_interval: int = 0
    checkpoint_dir: str = ""
    restore_id: int | None = None
    dataset: str = ""  # the dataset directory the ranks read; "": synthetic tokens
    eval_every: int = 0  # validation loss after every eval_every steps (0: never)
    eval_batches: int = 4
    step_timeout_seconds: float = STEP_TIMEOUT_SECONDS  # a step's collectives (collective_timeouts.py)
    model_config: ModelConfig | None = resolved_field()  # `model` resolved once per rank process

    @classmethod
    def of(cls, order) -> "JobSettings":
        return cls(order.job_id, order.model, order.global_batch, order.micro_batch, order.seq, order.seed,
                   order.max_steps, order.report_every, order.timeout_seconds, order.checkpoint_interval,
                   order.checkpoint_dir, order.restore_id, order.dataset, order.eval_every, order.eval_batches,
                   order.step_timeout_seconds)

    @property
    def validation_every(self) -> int:
        """Steps between validation losses: the product evaluates a dataset's held-out split only."""
        return self.eval_every if self.dataset else 0

    def checkpointer(self, rank: int):
        from agents.runtime.checkpoints import Checkpointer

        return Checkpointer(self.checkpoint_interval, self.checkpoint_dir, rank, self.restore_id or 0)

    def config(self, layout: str):
        """TrainConfig for a layout: micro-batches per step follow the data parallelism the
        batch is cut over (a multimodal model's LLM's: the encoder's only splits its own work)."""
        from parallelism.layout.placement import batch_dp, place
        from parallelism.training.parallel import TrainConfig

        dp = batch_dp(place(self.tensors, layout))
        return TrainConfig(model=self.model, global_batch=self.global_batch, seq_len=self.seq,
                           micro_batches=self.global_batch // (self.micro_batch * dp), seed=self.seed,
                           total_steps=SCHEDULE_STEPS, dataset=self.dataset or None)


def rank_trainer(settings: JobSettings, layout: str, rank: int, shards: dict, scalars, ckpt):
    """The model's trainer for `layout` (run.build_trainer: HeteroTrainer for a multimodal
    model; collective: every rank of the default group calls it), with the checkpoint
    meshes built alongside while every rank is still there."""
    from parallelism.training.run import build_trainer

    trainer = build_trainer(settings.config(layout), layout, rank, shards, scalars)
    ckpt.prepare(trainer.placement)
    return trainer
