"""A layout switch as a rank lives it: an old rank hands its state over and moves to the
new layout (or back to the old one when the switch fails), a joining rank prepares while
the old ranks train and then takes part (parallelism/engine/switch.py moves the state)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from agents import protocol
from agents.runtime.collective_timeouts import set_wait
from agents.runtime.faults import faults
from agents.runtime.job_settings import JobSettings, rank_trainer
from agents.runtime.rank_reports import Reporter
from agents.runtime.run_files import renumbered_marker, switch_file, switched_marker, transferring_marker
from agents.runtime.step_boundary import Boundary, join_union, union_store
from agents.runtime.worlds import join_world, renumbered_world


class RolledBack(Exception):
    """The switch failed after the old layout was left; this rank is back on it. `checks`:
    the digest rows when the failure was a verification mismatch."""

    def __init__(self, trainer, reason: str, checks: list[dict] | None = None) -> None:
        super().__init__(reason)
        self.trainer, self.reason, self.checks = trainer, reason, checks


def kept_state(shards: dict, untouched: set) -> dict:
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


def switch_old_rank(trainer, order: protocol.JobSwitchOrder, settings: JobSettings, boundary: Boundary, ckpt):
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
    kept = kept_state(shards, untouched)
    lap("kept_state")
    store = boundary.store if rank == 0 else union_store(order, master=False, timeout=settings.timeout_seconds)
    dist.destroy_process_group()
    boundary.done_switches.add(order.transition_id)
    boundary.pending = None
    failure = None
    try:
        join_union(order, store, rank, settings.timeout_seconds)
        lap("union")
        if rank == 0:
            boundary.reporter.transition(order.transition_id, "transferring", step=scalars.step)
        def verifying(transfer_seconds: float) -> None:
            set_wait(settings.timeout_seconds)
            if rank == 0:
                boundary.reporter.transition(order.transition_id, "verifying", step=scalars.step,
                                             transfer_seconds=transfer_seconds)

        new, new_scalars, report = switch_state(spec, shards, scalars, src, order.layout, rank,
                                                staging_bytes=order.staging_bytes,
                                                gpus_per_node=order.gpus_per_node, prepared=prepared,
                                                on_verify=verifying, on_transfer=transfer_waits(settings),
                                                on_round=round_reporter(boundary.reporter, order, rank,
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
        trainer = rank_trainer(settings, order.layout, new_rank, new, new_scalars, new_ckpt)
        lap("trainer")
    except Exception as exc:  # EngineError (digests, a dead peer), a gloo error, a timeout
        failure = (f"{type(exc).__name__}: {exc}"[:1500], getattr(exc, "checks", None))
    if failure is not None:
        # Rolled back outside the except clause: the exception's frames hold the union
        # world, and until it is freed this rank's connections stay open, so a peer waiting
        # on this rank in a collective would wait for the whole time-out instead of failing
        # at once and rolling back too (a lost joining node froze the old ranks 120 s).
        raise RolledBack(back_to_old_layout(order, store, rank, src, kept, scalars, settings, ckpt), *failure)
    if report.renumbered:
        (boundary.run_dir / renumbered_marker(switch_file(order.transition_id))).touch()
    return (trainer if trainer.active else None), report, phases, new_ckpt


def transfer_waits(settings: JobSettings, stall: float = 0.0):
    """switch_state's on_transfer: the transfer's rounds wait the step timeout for a peer, not the
    switch's long one (a round moves at most the staging budget; a peer silent that long is gone:
    a host cut off mid-transfer is found as in a training step, docs/hosts.md), until on_verify
    gives the long wait back. `stall`: a fault injection's hold, past the barrier (its peers wait
    in the first round)."""
    def on_transfer() -> None:
        set_wait(settings.step_timeout_seconds)
        if stall:
            time.sleep(stall)
    return on_transfer


PROGRESS_INTERVAL = 0.5  # seconds between live transfer reports (the first and last round always go)


def round_reporter(reporter: Reporter, order: protocol.JobSwitchOrder, rank: int, step: int):
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


def back_to_old_layout(order: protocol.JobSwitchOrder, store, rank: int, src: str, kept: dict, scalars,
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
    return rank_trainer(settings, src, rank, kept, scalars, ckpt)


def join_switch(order: protocol.JobSwitchOrder, rank: int, settings: JobSettings, run_dir: Path, ckpt):
    """A joining process (`rank`: its number in the union world): prepare while the old
    ranks train, then take part in the switch. Returns (trainer or None when the process
    takes no rank, the checkpointer of the rank it takes)."""
    from parallelism.training.parallel import TrainScalars
    from parallelism.engine.switch import prepare_switch, switch_state

    spec = settings.tensors
    prepared = prepare_switch(spec, order.src_layout, order.layout, rank, joining=True,
                              staging_bytes=order.staging_bytes, gpus_per_node=order.gpus_per_node,
                              process_of=order.process_of)
    store = union_store(order, master=False, timeout=settings.timeout_seconds)
    store.add("joined", 1)
    join_union(order, store, rank, settings.timeout_seconds)
    (run_dir / transferring_marker(order.transition_id, rank)).touch()  # a death now rolls the switch back
    for fault in faults():
        if fault == f"exit-in-transfer:{rank}":
            os._exit(17)
        if fault.startswith(f"hold-in-transfer:{rank}:"):  # hold the union world in the transfer (tests kill a node)
            time.sleep(float(fault.rsplit(":", 1)[1]))
    stall = next((float(f.rsplit(":", 1)[1]) for f in faults() if f.startswith(f"stall-in-transfer:{rank}:")), 0.0)
    new, scalars, report = switch_state(spec, {}, TrainScalars(), order.src_layout, order.layout, rank,
                                        staging_bytes=order.staging_bytes, gpus_per_node=order.gpus_per_node,
                                        prepared=prepared, process_of=order.process_of,
                                        on_transfer=transfer_waits(settings, stall),
                                        on_verify=lambda seconds: set_wait(settings.timeout_seconds))
    (run_dir / switched_marker(order.transition_id, rank)).touch()  # from here on, a death fails the job
    if not report.renumbered:
        return rank_trainer(settings, order.layout, rank, new, scalars, ckpt), ckpt
    if not renumbered_world(store, f"layout-{order.transition_id}", report.rank, order.world,
                            settings.timeout_seconds):
        return None, ckpt
    ckpt = settings.checkpointer(report.rank)
    trainer = rank_trainer(settings, order.layout, report.rank, new, scalars, ckpt)
    (run_dir / renumbered_marker(switch_file(order.transition_id))).touch()
    return trainer, ckpt
