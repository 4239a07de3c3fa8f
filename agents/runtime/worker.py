"""One rank of a job run by a node agent.

    python -m agents.runtime.worker ORDER RANK          a rank of a starting job
    python -m agents.runtime.worker --join ORDER RANK   a rank joining at a layout switch
    python -m agents.runtime.worker --abort ORDER WHY   (agents) abandon a switch being prepared

ORDER is the JobStartOrder / JobSwitchOrder (agents/protocol.py) the agent wrote as JSON
into the job's run folder. The rank trains step after step; after every step the job's
active ranks agree (one all-reduce, MAX) on what happens next, so that every rank acts
after the same step and none is left waiting in a collective:
- stop: a rank's agent asked (the file `stop` in its run folder) or max_steps is reached;
- switch: rank 0's agent delivered a JobSwitchOrder (a file `switch-<id>.json`) and every
  joining rank is ready.

A switch, with the joining ranks' start-up hidden behind training:
1. rank 0 sees the order, opens the union world's TCPStore at the order's rendezvous and
   reports `preparing`; the joining ranks start (their agents got the same order), plan
   the switch, allocate and touch their new shards, then add themselves to the store's
   `joined` counter, and wait in init_process_group;
2. at the first step boundary where `joined` is complete, the old ranks agree, rank 0
   broadcasts the order, every old rank hands its state over, leaves the old world and
   joins the union world (ranks 0 .. max(old, new) - 1) on that store;
3. the engine moves the state (parallelism/engine/switch.py switch_state: plan fingerprints,
   rounds, digest verification); ranks outside the new layout exit, the others build the
   new layout's trainer and go on. Rank 0 reports `ready`, `transferring` and
   `committed` with the timings (prepare: order seen to all joined, hidden behind
   training; pause: last old step to the first new step; transfer; verify).

Rank 0 speaks for the job (JobReport / TransitionReport to the control queue); a rank that
fails exits non-zero with its traceback on stderr and its agent reports it, except when a
peer is lost while training: then it keeps its state and waits for a recovery order
(agents/runtime/orphan.py), and may go on as a rank of the survivors' world.
"""
from __future__ import annotations

import datetime
import faulthandler
import functools
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from agents import protocol
from parallelism.layout.model_request import ModelConfig, NamesAModel, resolved_field
from agents.runtime.run_files import (STOP_FILE, done_switches, renumbered_marker, switch_file, switched_marker,
                                      transferring_marker)
from agents.runtime.worlds import backend, join_world, renumbered_world, rendezvous_store

# The LR schedule's length. Not max_steps: stopping a job early (or late) must not change
# what it trains on the steps it does run.
SCHEDULE_STEPS = 10_000


class Reporter:
    """Sends reports to the control queue (rank 0 only; other ranks stay silent). Job
    reports travel in batches (agents/runtime/batching.py, task control.ingest_events);
    a transition report first flushes the steps before it."""

    def __init__(self, job_id: int, rank: int, node: str, broker_url: str | None,
                 restore_id: int | None = None) -> None:
        self.job_id, self.node, self.restore_id = job_id, node, restore_id
        self.app = self.batcher = None
        if rank == 0 and broker_url:
            import atexit

            from celery import Celery

            from agents.runtime.batching import ReportBatcher

            self.app = Celery(f"job-{job_id}-rank-0", broker=broker_url, set_as_current=False)
            self.app.conf.update(task_serializer="json", broker_connection_retry_on_startup=True)
            self.batcher = ReportBatcher(lambda batch: self._send(protocol.CONTROL_INGEST_EVENTS, batch),
                                         job_id=job_id, node=node)
            atexit.register(self.batcher.close)

    def _send(self, task: str, message) -> None:
        if self.app is not None:
            self.app.send_task(task, args=[message.model_dump(mode="json")], queue=protocol.CONTROL_QUEUE)

    def job(self, kind: str, **fields) -> None:
        if self.batcher is not None:
            self.batcher.add(protocol.job_report(job_id=self.job_id, node=self.node, kind=kind, sent_at=_now(),
                                                **{"restore_id": self.restore_id, **fields}))

    def transition(self, transition_id: int, state: str, **fields) -> None:
        if self.batcher is not None:
            self.batcher.flush()
        self._send(protocol.CONTROL_TRANSITION_REPORT, protocol.TransitionReport(
            job_id=self.job_id, transition_id=transition_id, node=self.node, state=state, sent_at=_now(), **fields))


@functools.cache
def faults() -> frozenset[str]:
    """Fault injection for the tests: DYNAPLANE_FAULT, comma-separated: `exit-in-transfer:R`,
    `hold-in-transfer:R:SECONDS` (a joining rank R), `exit-after-step:R:S` (rank R exits
    once step S is done, before the step boundary: its peers all fail after that step).
    Read once per process (the step loop asks after every step)."""
    return frozenset(item.strip() for item in os.environ.get("DYNAPLANE_FAULT", "").split(",") if item.strip())


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


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
    model_config: ModelConfig | None = resolved_field()  # `model` resolved once per rank process

    @classmethod
    def of(cls, order) -> "JobSettings":
        return cls(order.job_id, order.model, order.global_batch, order.micro_batch, order.seq, order.seed,
                   order.max_steps, order.report_every, order.timeout_seconds, order.checkpoint_interval,
                   order.checkpoint_dir, order.restore_id)

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
                           total_steps=SCHEDULE_STEPS)


def _trainer(settings: JobSettings, layout: str, rank: int, shards: dict, scalars, ckpt):
    """The model's trainer for `layout` (run.build_trainer: HeteroTrainer for a multimodal
    model; collective: every rank of the default group calls it), with the checkpoint
    meshes built alongside while every rank is still there."""
    from parallelism.training.run import build_trainer

    trainer = build_trainer(settings.config(layout), layout, rank, shards, scalars)
    ckpt.prepare(trainer.placement)
    return trainer


def _store(order: protocol.JobSwitchOrder, master: bool, timeout: float):
    """The union world's TCPStore: rank 0 serves it, every other rank connects."""
    return rendezvous_store(order.rendezvous, master, timeout)


def _join_union(order: protocol.JobSwitchOrder, store, rank: int, timeout: float) -> None:
    join_world(store, f"union-{order.transition_id}", rank, max(order.src_world, order.world), timeout)


class Boundary:
    """The decision all active ranks take together after each step."""

    def __init__(self, settings: JobSettings, rank: int, run_dir: Path, reporter: Reporter) -> None:
        self.settings, self.rank, self.run_dir, self.reporter = settings, rank, run_dir, reporter
        self.done_switches: set[int] = set()
        self.pending: protocol.JobSwitchOrder | None = None  # rank 0: the order being prepared
        self.store = None
        self.seen_at = 0.0
        self.ahead: dict[int, object] = {}  # transition id -> Future of its PreparedSwitch
        self._planner = None

    def _prepare_ahead(self, trainer) -> None:
        """Every old rank: a switch order its agent delivered is planned in a background
        thread while training goes on (plan, program, skipped digests), so that the pause
        does not wait for it. The agent writes the order into the run folder of every node
        with ranks of the job, so no rank has to be told."""
        from concurrent.futures import ThreadPoolExecutor

        from parallelism.engine.switch import prepare_switch

        for path in self.run_dir.glob("switch-*.json"):
            tid = path.stem.split("-", 1)[1]
            if not tid.isdigit() or int(tid) in self.done_switches or int(tid) in self.ahead:
                continue
            order = protocol.JobSwitchOrder.model_validate_json(path.read_text())
            self._planner = self._planner or ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-ahead")
            self.ahead[int(tid)] = self._planner.submit(
                prepare_switch, trainer.spec, str(trainer.placement.layout), order.layout, self.rank, False,
                staging_bytes=order.staging_bytes, gpus_per_node=order.gpus_per_node, process_of=order.process_of)

    def prepared(self, order: protocol.JobSwitchOrder, spec, src: str):
        """The order's PreparedSwitch, planned ahead (waiting for it if it is still being
        planned) or now."""
        from parallelism.engine.switch import prepare_switch

        future = self.ahead.pop(order.transition_id, None)
        if future is not None:
            try:
                prepared = future.result()
            except Exception:  # noqa: BLE001 (planned again below, where a failure rolls the switch back)
                prepared = None
            if prepared is not None and str(prepared.plan.src.layout) == src:
                return prepared
        return prepare_switch(spec, src, order.layout, self.rank, joining=False, staging_bytes=order.staging_bytes,
                              gpus_per_node=order.gpus_per_node, process_of=order.process_of)

    def _look_for_switch(self) -> None:
        if self.pending is not None:
            return
        for path in sorted(self.run_dir.glob("switch-*.json")):
            order = protocol.JobSwitchOrder.model_validate_json(path.read_text())
            if order.transition_id in self.done_switches:
                continue
            self.pending, self.seen_at = order, time.perf_counter()
            self.store = _store(order, master=True, timeout=self.settings.timeout_seconds)
            self.reporter.transition(order.transition_id, "preparing")
            return

    def _abandoned(self) -> str | None:
        """Rank 0: give the pending switch up if a joining rank's agent reported it dead
        (the store's `abort` key) or the joining ranks are not ready within the job's
        timeout. The old layout never left: training simply goes on."""
        order = self.pending
        reason = None
        if self.store.check(["abort"]):
            reason = self.store.get("abort").decode(errors="replace")
        elif time.perf_counter() - self.seen_at > self.settings.timeout_seconds:
            joined = int(self.store.add("joined", 0))
            reason = (f"{joined} of {order.world - order.src_world} joining ranks ready after "
                      f"{self.settings.timeout_seconds:.0f} s")
        if reason is None:
            return None
        self.reporter.transition(order.transition_id, "aborted", error=f"switch abandoned: {reason}"[:4000])
        self.done_switches.add(order.transition_id)
        self.pending, self.store = None, None  # closes the store: joining ranks waiting on it fail
        return reason

    def decide(self, trainer) -> tuple[bool, protocol.JobSwitchOrder | None]:
        """(stop, switch order) agreed by every active rank after this step."""
        import torch
        import torch.distributed as dist

        stop = (self.run_dir / STOP_FILE).exists() or (
            self.settings.max_steps is not None and trainer.scalars.step >= self.settings.max_steps)
        self._prepare_ahead(trainer)
        ready = 0
        if self.rank == 0:
            self._look_for_switch()
            if self.pending is not None and self._abandoned() is None:
                joining = max(0, self.pending.world - self.pending.src_world)
                if int(self.store.add("joined", 0)) >= joining:
                    ready = self.pending.transition_id
        planning = any(not future.done() for future in self.ahead.values())
        flags = torch.tensor([int(stop), ready, int(planning)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=trainer.meshes.everyone)
        if flags[0].item():
            return True, None
        if not flags[1].item() or flags[2].item():  # (a rank still planning ahead: switch a step later)
            return False, None
        box = [self.pending]
        dist.broadcast_object_list(box, src=0, group=trainer.meshes.everyone)
        order = box[0]
        if self.rank == 0:
            self.reporter.transition(order.transition_id, "ready", step=trainer.scalars.step,
                                     prepare_seconds=time.perf_counter() - self.seen_at)
        return False, order


class RolledBack(Exception):
    """The switch failed after the old layout was left; this rank is back on it. `checks`:
    the digest rows when the failure was a verification mismatch."""

    def __init__(self, trainer, reason: str, checks: list[dict] | None = None) -> None:
        super().__init__(reason)
        self.trainer, self.reason, self.checks = trainer, reason, checks


def _kept_state(shards: dict, untouched: set) -> dict:
    """The old state, kept until the commit point. The engine never writes into a source
    shard (it reads them, and frees each after its last read), so a shard is kept by
    reference: its memory then stays until the commit instead of being freed during the
    transfer, which on the host is exactly what a copy would cost, without the copying (a
    dp=4 -> dp=2 llama-124m shrink: the leaving ranks copied 2 GB each, 0.4 s of the
    pause). A device shard that the switch rewrites or frees (not in `untouched`: the same
    box in the new layout, which the engine keeps as it is) is copied to the host, so that
    the device memory it frees serves the new layout."""
    from parallelism.engine.shards import LocalShard

    return {key: s if key in untouched or s.data.device.type == "cpu"
            else LocalShard(s.tensor, s.state, s.box, s.data.detach().to("cpu", copy=True))
            for key, s in shards.items()}


def _switch_old_rank(trainer, order: protocol.JobSwitchOrder, settings: JobSettings, boundary: Boundary, ckpt):
    """Hand this rank's state over and move it to the new layout; None if the rank leaves.
    Raises RolledBack (carrying a trainer on the old layout, rebuilt from the state kept
    until the commit point) when the switch fails: a peer lost during the transfer, or a
    digest that does not match. Returns (trainer, report, phases: seconds per step of the
    pause, in order, the checkpointer of the rank the process now is)."""
    import torch.distributed as dist

    from parallelism.engine.switch import switch_state

    phases: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        phases[name], clock = now - clock, now

    rank = trainer.rank
    src = str(trainer.placement.layout)
    try:
        prepared = boundary.prepared(order, trainer.spec, src)
    except Exception:  # noqa: BLE001 (switch_state plans again inside the rollback's reach and fails there)
        prepared = None
    lap("plan")
    shards, scalars = trainer.hand_over()
    spec = trainer.spec
    del trainer
    lap("hand_over")
    new_boxes = prepared.program.new_boxes if prepared is not None else {}
    untouched = {key for key, box in new_boxes.items() if key in shards and shards[key].box == box}
    kept = _kept_state(shards, untouched)
    lap("kept_state")
    store = boundary.store if rank == 0 else _store(order, master=False, timeout=settings.timeout_seconds)
    dist.destroy_process_group()
    boundary.done_switches.add(order.transition_id)
    boundary.pending = None
    failure = None
    try:
        _join_union(order, store, rank, settings.timeout_seconds)
        lap("union")
        if rank == 0:
            boundary.reporter.transition(order.transition_id, "transferring", step=scalars.step)
        def verifying(transfer_seconds: float) -> None:
            if rank == 0:
                boundary.reporter.transition(order.transition_id, "verifying", step=scalars.step,
                                             transfer_seconds=transfer_seconds)

        new, new_scalars, report = switch_state(spec, shards, scalars, src, order.layout, rank,
                                                staging_bytes=order.staging_bytes,
                                                gpus_per_node=order.gpus_per_node, prepared=prepared,
                                                on_verify=verifying,
                                                on_round=_round_reporter(boundary.reporter, order, rank,
                                                                         scalars.step),
                                                process_of=order.process_of)
        clock = time.perf_counter()
        phases.update({name: seconds for name, seconds in report.phases.items() if name != "plan"})
        new_rank, new_ckpt = rank, ckpt
        if report.renumbered:
            if not renumbered_world(store, f"layout-{order.transition_id}", report.rank, order.world,
                                    settings.timeout_seconds):
                return None, report, phases, ckpt
            lap("new_world")
            new_rank, new_ckpt = report.rank, settings.checkpointer(report.rank)
        # Every rank of the world builds the trainer: its process groups are made
        # collectively, by members and non-members alike. A rank outside the layout then leaves.
        trainer = _trainer(settings, order.layout, new_rank, new, new_scalars, new_ckpt)
        lap("trainer")
    except Exception as exc:  # EngineError (digests, a dead peer), a gloo error, a timeout
        failure = (f"{type(exc).__name__}: {exc}"[:1500], getattr(exc, "checks", None))
    if failure is not None:
        # Rolled back outside the except clause: the exception's frames hold the union
        # world, and until it is freed this rank's connections stay open, so a peer waiting
        # on this rank in a collective would wait for the whole time-out instead of failing
        # at once and rolling back too (a lost joining node froze the old ranks 120 s).
        raise RolledBack(_back_to_old_layout(order, store, rank, src, kept, scalars, settings, ckpt), *failure)
    if report.renumbered:
        (boundary.run_dir / renumbered_marker(switch_file(order.transition_id))).touch()
    return (trainer if trainer.active else None), report, phases, new_ckpt


PROGRESS_INTERVAL = 0.5  # seconds between live transfer reports (the first and last round always go)


def _round_reporter(reporter: Reporter, order: protocol.JobSwitchOrder, rank: int, step: int):
    """Rank 0's on_round for switch_state: a throttled `transferring` report with the
    round reached and its measured wave so far (other ranks send nothing)."""
    if rank != 0:
        return None
    from parallelism.engine.progress import Throttle

    throttle = Throttle(PROGRESS_INTERVAL)

    def on_round(done: int, rounds: int, moved_bytes: int, wave: list[int]) -> None:
        if throttle.due(final=done >= rounds):
            reporter.transition(order.transition_id, "transferring", step=step, progress=protocol.TransferProgress(
                round=done, rounds=rounds, moved_bytes=moved_bytes, waves={0: wave}))
    return on_round


def _back_to_old_layout(order: protocol.JobSwitchOrder, store, rank: int, src: str, kept: dict, scalars,
                        settings: JobSettings, ckpt):
    """The old ranks leave the broken union world and form the old one again on rank 0's
    store, with the state they kept. (If an old rank is the one lost, this cannot work and
    times out; the control plane then restores the job from its latest checkpoint.)"""
    import gc

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # the broken world's last references (cycles of its failed calls' frames): its connections close
    join_world(store, f"rollback-{order.transition_id}", rank, order.src_world, settings.timeout_seconds)
    return _trainer(settings, src, rank, kept, scalars, ckpt)


def _join(order: protocol.JobSwitchOrder, rank: int, settings: JobSettings, run_dir: Path, ckpt):
    """A joining process (`rank`: its number in the union world): prepare while the old
    ranks train, then take part in the switch. Returns (trainer or None when the process
    takes no rank, the checkpointer of the rank it takes)."""
    from parallelism.training.parallel import TrainScalars
    from parallelism.engine.switch import prepare_switch, switch_state

    spec = settings.tensors
    prepared = prepare_switch(spec, order.src_layout, order.layout, rank, joining=True,
                              staging_bytes=order.staging_bytes, gpus_per_node=order.gpus_per_node,
                              process_of=order.process_of)
    store = _store(order, master=False, timeout=settings.timeout_seconds)
    store.add("joined", 1)
    _join_union(order, store, rank, settings.timeout_seconds)
    (run_dir / transferring_marker(order.transition_id, rank)).touch()  # a death now rolls the switch back
    for fault in faults():
        if fault == f"exit-in-transfer:{rank}":
            os._exit(17)
        if fault.startswith(f"hold-in-transfer:{rank}:"):  # hold the union world in the transfer (tests kill a node)
            time.sleep(float(fault.rsplit(":", 1)[1]))
    new, scalars, report = switch_state(spec, {}, TrainScalars(), order.src_layout, order.layout, rank,
                                        staging_bytes=order.staging_bytes, gpus_per_node=order.gpus_per_node,
                                        prepared=prepared, process_of=order.process_of)
    (run_dir / switched_marker(order.transition_id, rank)).touch()  # from here on, a death fails the job
    if not report.renumbered:
        return _trainer(settings, order.layout, rank, new, scalars, ckpt), ckpt
    if not renumbered_world(store, f"layout-{order.transition_id}", report.rank, order.world,
                            settings.timeout_seconds):
        return None, ckpt
    ckpt = settings.checkpointer(report.rank)
    trainer = _trainer(settings, order.layout, report.rank, new, scalars, ckpt)
    (run_dir / renumbered_marker(switch_file(order.transition_id))).touch()
    return trainer, ckpt


def _train(trainer, settings: JobSettings, rank: int, run_dir: Path, reporter: Reporter,
           done_switches: set[int], ckpt, committed=None) -> int:
    """Steps until the job stops or this rank leaves the layout; returns steps done here.
    Raises Orphaned when a peer is lost in a step or at the step boundary (orphan.py)."""
    import torch.distributed as dist

    boundary = Boundary(settings, rank, run_dir, reporter)
    boundary.done_switches |= done_switches
    steps = 0  # committed: (transition id, report, pause start, phases) until the next step
    while True:
        step_started = time.perf_counter()
        try:
            result = trainer.step()
        except RuntimeError as exc:  # only the errors of a lost peer (orphan.peer_lost) are kept
            _orphaned(trainer, rank, exc)
            raise
        steps += 1
        if rank == 0 and result is not None:
            if committed is not None:
                tid, report, paused_at, phases = committed
                phases = {**phases, "other": max(0.0, step_started - paused_at - sum(phases.values()))}
                reporter.transition(tid, "committed", step=report.step, pause_seconds=step_started - paused_at,
                                    phases=phases,
                                    transfer_seconds=report.seconds, verify_seconds=report.verify_seconds,
                                    network_bytes=report.network_bytes, rounds=report.rounds,
                                    peak_bytes=report.peak_bytes, predicted_peak_bytes=report.predicted_peak_bytes,
                                    fingerprint=report.fingerprint, verified=report.verified,
                                    progress=protocol.TransferProgress(
                                        round=report.rounds, rounds=report.rounds, moved_bytes=report.network_bytes,
                                        waves=dict(enumerate(report.measured_waves))),
                                    tensors=report.checks)
            if steps == 1:  # rank 0 is in every layout: it started with the job
                reporter.job("started", step=result.step, layout=str(trainer.placement.layout))
            if result.step % settings.report_every == 0:
                reporter.job("step", step=result.step, loss=result.loss, step_seconds=result.seconds,
                             tokens_per_second=result.tokens / result.seconds, layout=str(trainer.placement.layout))
        committed = None
        if f"exit-after-step:{rank}:{trainer.scalars.step}" in faults():
            os._exit(17)
        if ckpt.due(trainer.scalars.step):
            trainer, path, seconds = ckpt.save(trainer, settings.config(str(trainer.placement.layout)))
            if rank == 0:
                reporter.job("checkpoint", step=trainer.scalars.step, checkpoint_path=str(path), seconds=seconds,
                             layout=str(trainer.placement.layout))
        try:
            stop, order = boundary.decide(trainer)
        except RuntimeError as exc:
            _orphaned(trainer, rank, exc)
            raise
        if stop:
            if rank == 0:
                reporter.job("stopped", step=trainer.scalars.step, layout=str(trainer.placement.layout))
            dist.destroy_process_group()
            return steps
        if order is not None:
            paused_at = time.perf_counter()
            try:
                trainer, report, phases, ckpt = _switch_old_rank(trainer, order, settings, boundary, ckpt)
            except RolledBack as back:
                trainer = back.trainer
                if rank == 0:
                    reporter.transition(order.transition_id, "rolled_back", step=trainer.scalars.step,
                                        pause_seconds=time.perf_counter() - paused_at,
                                        error=f"switch failed, back on {trainer.placement.layout}: {back.reason}",
                                        tensors=back.checks)  # a digest mismatch
                continue
            if trainer is None:  # this rank is not in the new layout: its state has been handed over
                if dist.is_initialized():
                    dist.destroy_process_group()
                return steps
            rank = boundary.rank = trainer.rank  # (another number under a device map; rank 0 stays)
            committed = (order.transition_id, report, paused_at, phases)


def _orphaned(trainer, rank: int, exc: RuntimeError) -> None:
    """Raise Orphaned with this rank's state when `exc` is a lost peer's error and the state
    is whole; else return (the caller re-raises `exc`: the rank exits, its agent reports it)."""
    from agents.runtime.orphan import Orphaned, orphan_of, peer_lost

    orphan = orphan_of(trainer, rank, exc) if peer_lost(exc) else None
    if orphan is not None:
        raise Orphaned(orphan) from None


def _survive(orphan, settings: JobSettings, run_dir: Path, node: str, broker: str | None):
    """Wait for the recovery order and go on in the survivors' world: (trainer, settings,
    rank, reporter, checkpointer, committed) for _train, or None when this rank is done."""
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
    rank, settings, shards, scalars, report, marker = got
    ckpt = settings.checkpointer(rank)
    trainer = _trainer(settings, order.layout, rank, shards, scalars, ckpt)
    if marker is not None:
        (run_dir / marker).touch()
    if not trainer.active:  # beyond the recovered layout: the state has been handed over
        dist.destroy_process_group()
        return None
    print(f"rank {orphan.rank}: rank {rank} of {order.layout} after restore {order.restore_id}", file=sys.stderr)
    reporter = Reporter(settings.job_id, rank, node, broker, order.restore_id)
    return trainer, settings, rank, reporter, ckpt, (order.restore_id, report, orphan.lost_at, dict(report.phases))


def signal_abort(order: protocol.JobSwitchOrder, reason: str) -> None:
    """Tell rank 0 (through the union store's `abort` key) that a switch cannot happen."""
    _store(order, master=False, timeout=10).set("abort", reason)


def _freeze_imports() -> None:
    """Import what a rank runs, then move every object alive so far out of the garbage
    collector's reach (gc.freeze): a full collection then walks only the objects made since
    (the trainers, never frozen, so theirs are still collected). Measured on llama-124m: a
    collection that came during a switch's pause took 0.16-0.32 s walking torch's
    hundreds of thousands of module-level objects, 0.02 s after this."""
    import gc

    import torch.distributed.pipelining  # noqa: F401 (0.47 s here: in a pause it cost a switch into pp > 1 as much)

    import parallelism.engine.execute  # noqa: F401
    import agents.runtime.checkpoints  # noqa: F401
    import agents.runtime.orphan  # noqa: F401
    import parallelism.engine.switch  # noqa: F401
    import parallelism.training.run  # noqa: F401

    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--abort"] and len(argv) == 3:  # run by an agent whose joining rank died
        signal_abort(protocol.JobSwitchOrder.model_validate_json(Path(argv[1]).read_text()), argv[2])
        return 0
    joining = argv[:1] == ["--join"]
    args = argv[1:] if joining else argv
    if len(args) != 2:
        print("usage: python -m agents.runtime.worker [--join] ORDER_JSON RANK", file=sys.stderr)
        return 2
    path, rank = Path(args[0]), int(args[1])
    started = time.perf_counter()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the rank log
    import torch

    torch.set_num_threads(int(os.environ.get("DYNAPLANE_RANK_THREADS", "1")))
    _freeze_imports()
    node, broker = os.environ.get("DYNAPLANE_NODE", ""), os.environ.get("DYNAPLANE_BROKER_URL")
    if joining:
        order = protocol.JobSwitchOrder.model_validate_json(path.read_text())
        settings = JobSettings.of(order)
        reporter = Reporter(order.job_id, rank, node, broker, order.restore_id)
        trainer, ckpt = _join(order, rank, settings, path.parent, settings.checkpointer(rank))
        done = {order.transition_id}
        if trainer is None or not trainer.active:  # no rank of the new layout for this process
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            return 0
        rank = trainer.rank
    else:
        import torch.distributed as dist

        from parallelism.layout.placement import place
        from agents.runtime.checkpoints import restore
        from parallelism.training.parallel import initial_shards
        from parallelism.training.run import build_trainer

        order = protocol.JobStartOrder.model_validate_json(path.read_text())
        settings = JobSettings.of(order)
        reporter = Reporter(order.job_id, rank, node, broker, order.restore_id)
        ckpt = settings.checkpointer(rank)
        dist.init_process_group(backend(), init_method=f"tcp://{order.rendezvous}", rank=rank,
                                world_size=order.world, timeout=datetime.timedelta(seconds=order.timeout_seconds))
        placement = place(settings.tensors, order.layout)
        if order.restore_from:  # a restart after a failure: the state comes from the checkpoint
            loading = time.perf_counter()
            ckpt.prepare(placement, force=True)
            shards, scalars, verified = restore(settings.tensors, order.layout, rank, order.restore_from, ckpt.meshes)
            # (the meshes just built serve the periodic checkpoints of this world as well)
            trainer = build_trainer(settings.config(order.layout), order.layout, rank, shards, scalars)
            if rank == 0:
                reporter.job("restored", step=scalars.step, checkpoint_path=order.restore_from, verified=verified,
                             seconds=time.perf_counter() - loading, layout=order.layout)
        else:
            trainer = _trainer(settings, order.layout, rank, initial_shards(placement, rank, order.seed),
                               None, ckpt)
        done = set()
        # (the first line of the rank's log, which the job page shows for rank 0)
        print(f"rank {rank}: training {order.layout} on {order.world} ranks, ready in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    from agents.runtime.orphan import Orphaned

    steps, committed = 0, None
    while True:
        try:
            steps += _train(trainer, settings, rank, path.parent, reporter, done, ckpt, committed)
            break
        except Orphaned as lost:
            orphan = lost.orphan
        trainer = None
        resumed = _survive(orphan, settings, path.parent, node, broker)
        if resumed is None:
            print(f"rank {orphan.rank}: leaves after its world broke", file=sys.stderr)
            return 0
        trainer, settings, rank, reporter, ckpt, committed = resumed
        done = done_switches(path.parent)
    print(f"rank {rank}: {steps} steps in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
