"""A rank's training loop: steps, reports, checkpoints, and at each step boundary a stop or
a switch; a rank whose world broke waits for a recovery order and goes on."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from agents import protocol
from agents.runtime.collective_timeouts import CollectiveTimeouts
from agents.runtime.faults import faults
from agents.runtime.job_settings import JobSettings, rank_trainer
from agents.runtime.rank_reports import Reporter
from agents.runtime.run_files import STOP_FILE
from agents.runtime.sample_log import SampleLog, whole_batch
from agents.runtime.step_boundary import Boundary
from agents.runtime.switching import RolledBack, switch_old_rank
from parallelism.training.loop import run_loop


def train(trainer, settings: JobSettings, rank: int, run_dir: Path, reporter: Reporter,
          done_switches: set[int], ckpt, committed=None) -> int:
    """Steps until the job stops or this rank leaves the layout; returns steps done here.
    Raises Orphaned when a peer is lost in a step or at the step boundary (orphan.py). The loop
    is the CLI's (parallelism/training/loop.py); what a rank of a job does around it is `JobRounds`."""
    rounds = JobRounds(settings, rank, run_dir, reporter, done_switches, ckpt, committed)
    if rounds.samples is not None:
        rounds.samples.starts_at(trainer.scalars.step)
    if any(fault.startswith(f"exit-before-loss-sum:{rank}:") for fault in faults()) and hasattr(trainer, "on_update"):
        trainer.on_update = lambda step: os._exit(17) if f"exit-before-loss-sum:{rank}:{step}" in faults() else None
    return run_loop(trainer, rounds, eval_every=settings.validation_every, eval_batches=settings.eval_batches)


class JobRounds:
    """A job's rank around the loop (loop.Rounds): the record of what it read, rank 0's reports,
    checkpoints, and at each step boundary the control plane's stop or switch."""

    def __init__(self, settings: JobSettings, rank: int, run_dir: Path, reporter: Reporter,
                 done_switches: set[int], ckpt, committed=None) -> None:
        self.settings, self.rank, self.reporter, self.ckpt = settings, rank, reporter, ckpt
        # The first step of a world waits long (its peers may still be warming up), the next ones short.
        self.waits = CollectiveTimeouts(settings.timeout_seconds, settings.step_timeout_seconds)
        self.edge = Boundary(settings, rank, run_dir, reporter)
        self.edge.done_switches |= done_switches
        self.committed = committed  # (transition id, report, pause start, phases) until the next step
        self.steps = 0
        logged = settings.dataset and settings.checkpoint_dir  # the record of what was read (sample_log.py)
        self.samples = SampleLog(settings.checkpoint_dir, reporter.node) if logged else None
        self.step_started = time.perf_counter()

    def failed(self, trainer, exc: RuntimeError, step_before: int) -> None:
        """Only a lost peer's errors are kept (orphan.peer_lost): then Orphaned is raised."""
        self._read_by_all(trainer, step_before)
        orphaned(trainer, self.rank, exc, self.reporter, self.settings, step_before)

    def _read_by_all(self, trainer, step_before: int) -> None:
        """A peer is lost: record every data rank's slice of the last step whose update this rank
        completed in this layout, if it is at or after `step_before`: the step that failed, if its
        update went through (the state moved on with it), else the one before (a peer lost after
        that step's all-reduce may have died before writing its own record). Its update summed
        every data rank's gradient, so every slice of it was read; equal reads collapse."""
        trained = getattr(trainer, "trained", None)
        if self.samples is not None and trained is not None and trained.step >= step_before:
            for read in whole_batch(trainer, trained):
                self.samples.record(read, str(trainer.placement.layout))

    def stepped(self, trainer, result, validation: float | None) -> None:
        if self.samples is not None:
            self.samples.record(result, str(trainer.placement.layout))
        self.steps += 1
        if self.rank == 0 and result is not None:
            if self.committed is not None:
                self._report_commit(self.committed)
            if self.steps == 1:  # rank 0 is in every layout: it started with the job
                self.reporter.job("started", step=result.step, layout=str(trainer.placement.layout))
            report_step(self.reporter, self.settings, result, trainer, validation)
        self.committed = None
        if f"exit-after-step:{self.rank}:{trainer.scalars.step}" in faults():
            os._exit(17)

    def _report_commit(self, committed) -> None:
        """A switch commits on the first step its new layout completes."""
        tid, report, paused_at, phases = committed
        phases = {**phases, "other": max(0.0, self.step_started - paused_at - sum(phases.values()))}
        self.reporter.transition(tid, "committed", step=report.step, pause_seconds=self.step_started - paused_at,
                                 phases=phases,
                                 transfer_seconds=report.seconds, verify_seconds=report.verify_seconds,
                                 network_bytes=report.network_bytes, rounds=report.rounds,
                                 peak_bytes=report.peak_bytes, predicted_peak_bytes=report.predicted_peak_bytes,
                                 fingerprint=report.fingerprint, verified=report.verified,
                                 progress=protocol.TransferProgress(
                                     round=report.rounds, rounds=report.rounds, moved_bytes=report.network_bytes,
                                     waves=dict(enumerate(report.measured_waves))),
                                 tensors=report.checks)

    def boundary(self, trainer):
        import torch.distributed as dist

        settings, reporter = self.settings, self.reporter
        if self.ckpt.due(trainer.scalars.step):
            self.waits.patient()  # a rank may write its part for a while
            trainer, path, seconds = self.ckpt.save(trainer, settings.config(str(trainer.placement.layout)))
            if self.rank == 0:
                reporter.job("checkpoint", step=trainer.scalars.step, checkpoint_path=str(path), seconds=seconds,
                             layout=str(trainer.placement.layout))
        try:
            stop, order = self.edge.decide(trainer)
        except RuntimeError as exc:
            self._read_by_all(trainer, trainer.scalars.step)
            orphaned(trainer, self.rank, exc, reporter)
            raise
        if stop:
            if self.rank == 0:
                reporter.job("stopped", step=trainer.scalars.step, layout=str(trainer.placement.layout))
            dist.destroy_process_group()
            return None
        if order is None:
            self.waits.steady()  # the next step and boundary: a peer silent this long is gone
            self.step_started = time.perf_counter()
            return trainer
        paused_at = time.perf_counter()
        self.waits.patient()  # the switch, and the new world's first step
        try:
            trainer, report, phases, self.ckpt = switch_old_rank(trainer, order, settings, self.edge,
                                                                 self.ckpt)
        except RolledBack as back:
            trainer = back.trainer
            if self.rank == 0:
                reporter.transition(order.transition_id, "rolled_back", step=trainer.scalars.step,
                                    pause_seconds=time.perf_counter() - paused_at,
                                    error=f"switch failed, back on {trainer.placement.layout}: {back.reason}",
                                    tensors=back.checks)  # a digest mismatch
            self.step_started = time.perf_counter()
            return trainer
        if trainer is None:  # this rank is not in the new layout: its state has been handed over
            if dist.is_initialized():
                dist.destroy_process_group()
            return None
        self.rank = self.edge.rank = trainer.rank  # (another number under a device map; rank 0 stays)
        self.committed = (order.transition_id, report, paused_at, phases)
        self.step_started = time.perf_counter()
        return trainer


def report_step(reporter: Reporter, settings: JobSettings, result, trainer, validation: float | None = None) -> None:
    """Rank 0's report of a finished step (StepResult), every `report_every` steps, and of every
    step a validation loss followed."""
    if result.step % settings.report_every == 0 or validation is not None:
        reporter.job("step", step=result.step, loss=result.loss, step_seconds=result.seconds,
                     tokens_per_second=result.tokens / max(result.seconds, 1e-9), layout=str(trainer.placement.layout),
                     **({"validation_loss": validation} if validation is not None else {}))


def orphaned(trainer, rank: int, exc: RuntimeError, reporter: Reporter | None = None,
             settings: JobSettings | None = None, step_before: int | None = None) -> None:
    """Raise Orphaned with this rank's state when `exc` is a lost peer's error and the state
    is whole; else return (the caller re-raises `exc`: the rank exits, its agent reports it).

    A peer lost in a step's loss all-reduce leaves the step trained (the state moved on with
    it, orphan.py point 1): rank 0 reports that step with its loss unknown, so that the
    control plane's record of trained steps has no hole, and sends its waiting reports
    before it waits for the recovery order (its successor reports on a new stream)."""
    from agents.runtime.orphan import Orphaned, orphan_of, peer_lost

    orphan = orphan_of(trainer, rank, exc) if peer_lost(exc) else None
    if orphan is None:
        return
    trained = getattr(trainer, "trained", None)
    if step_before is not None and trained is not None and trained.step == orphan.scalars.step > step_before:
        orphan.trained = trained  # (whichever rank becomes rank 0 may have to report it)
    if rank == 0 and reporter is not None:
        if settings is not None and orphan.trained is not None:
            report_step(reporter, settings, orphan.trained, trainer)
        if reporter.batcher is not None:
            reporter.batcher.flush()
    raise Orphaned(orphan) from None


def survive(orphan, settings: JobSettings, run_dir: Path, node: str, broker: str | None):
    """Wait for the recovery order and go on in the survivors' world: (trainer, settings,
    rank, reporter, checkpointer, committed) for train, or None when this rank is done."""
    import torch.distributed as dist

    from agents.runtime.orphan import recover, wait_for_order

    print(f"rank {orphan.rank}: its world broke after step {orphan.scalars.step} ({orphan.error}); "
          f"waiting for a recovery order", file=sys.stderr)
    order = wait_for_order(orphan, run_dir, STOP_FILE, settings.restore_id, settings.timeout_seconds)
    got = recover(orphan, order, settings) if order is not None else None
    if got is None:
        if dist.is_initialized():
            dist.destroy_process_group()
        return None
    rank, settings, shards, scalars, report, marker, record = got
    ckpt = settings.checkpointer(rank)
    trainer = rank_trainer(settings, order.layout, rank, shards, scalars, ckpt)
    if marker is not None:
        (run_dir / marker).touch()
    if not trainer.active:  # beyond the recovered layout: the state has been handed over
        dist.destroy_process_group()
        return None
    print(f"rank {orphan.rank}: rank {rank} of {order.layout} after restore {order.restore_id}", file=sys.stderr)
    reporter = Reporter(settings.job_id, rank, node, broker, order.restore_id)
    if record is not None:  # the step the old rank 0, a step behind, never reported
        report_step(reporter, settings, record, trainer)
    return trainer, settings, rank, reporter, ckpt, (order.restore_id, report, orphan.lost_at, dict(report.phases))
