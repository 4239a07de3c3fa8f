"""A rank that outlives its world: a peer is lost while the job trains (docs/elastic.md,
"Failures and recovery"), and the rank keeps its state for a recovery without a checkpoint.

1. The training loop (worker._train) turns the distributed errors a lost peer raises in a
   step or at the step boundary (`peer_lost`: gloo's transport errors, torch's DistError;
   nothing else) into `Orphaned`, with the rank's shards and scalars, unless the failure
   tore the state (`trainer.torn`: between the optimizer's update and its publish; the
   rank then exits as before). A step that failed before the optimizer step leaves the
   state and scalars as they were after the previous step; one that failed in the loss
   all-reduce after it leaves both after this step: consistent either way.
2. `wait_for_order`: the rank leaves its broken world, leaves `orphaned-rank-<r>.json`
   (rank, step, error) for its agent, which reports it `orphaned`, and waits for the agent's
   `recover-<restore id>.json` (a JobRecoverOrder), at most the job's timeout; a stop
   request ends it quietly, a timeout with an error (its agent then reports the failure).
3. `recover`: the survivors meet at the order's rendezvous under their new numbers, check
   that they stopped at the order's step with equal replicas (`agreement`), and the engine
   switches their state onto the order's layout (digests verified), under the order's
   device map (a rank may then take another number once more).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from agents import protocol
from agents.runtime.run_files import orphan_marker, recover_file, renumbered_marker

# Where gloo's errors come from when a peer's connection closes, resets or times out.
_GLOO_TRANSPORT = "/gloo/transport/"
POLL_SECONDS = 0.2


def peer_lost(exc: BaseException) -> bool:
    """Is this the error a collective raises when a peer is gone? (not any RuntimeError)"""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and _GLOO_TRANSPORT in str(exc))


@dataclass
class Orphan:
    """What a rank keeps when its world breaks."""

    rank: int
    shards: dict
    scalars: object
    error: str
    lost_at: float = field(default_factory=time.perf_counter)
    # The step the broken collective still completed here (its StepResult: the state moved on
    # with it): reported by the new rank 0 when the old one stopped a step behind.
    trained: object = None


class Orphaned(Exception):
    def __init__(self, orphan: Orphan) -> None:
        super().__init__(orphan.error)
        self.orphan = orphan


class RecoveryError(RuntimeError):
    """The survivors cannot go on from their memory (they disagree, or the order is wrong)."""


def orphan_of(trainer, rank: int, exc: BaseException) -> Orphan | None:
    """The trainer's state after a lost peer, or None when the failure tore it (or the
    trainer cannot tell: HeteroTrainer, whose per-module layouts the recovery refuses)."""
    if getattr(trainer, "torn", True):
        return None
    shards, scalars = trainer.hand_over()
    return Orphan(rank, shards, scalars, f"{type(exc).__name__}: {exc}"[:1500])


def wait_for_order(orphan: Orphan, run_dir: Path, stop_file: str, restore_id: int | None,
                   timeout: float) -> protocol.JobRecoverOrder | None:
    """Tell the agent, then wait for its recovery order (None: stop requested)."""
    import json

    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    if (run_dir / stop_file).exists():
        return None
    tmp = run_dir / f".{orphan_marker(orphan.rank)}.tmp"
    tmp.write_text(json.dumps({"rank": orphan.rank, "step": orphan.scalars.step, "error": orphan.error}))
    tmp.replace(run_dir / orphan_marker(orphan.rank))  # the agent never reads half a file
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (run_dir / stop_file).exists():
            return None
        for path in sorted(run_dir.glob("recover-*.json")):
            order = protocol.JobRecoverOrder.model_validate_json(path.read_text())
            if order.restore_id != restore_id:
                return order
        time.sleep(POLL_SECONDS)
    raise RecoveryError(f"rank {orphan.rank}: its world broke after step {orphan.scalars.step} ({orphan.error}) "
                        f"and no recovery order came within {timeout:.0f} s")


def agreement(gathered: list[tuple[int, int, dict]], step: int, src_world: int) -> str | None:
    """Why the survivors' memories cannot be one state (None: they agree). gathered[new
    rank] = (step, data samples, {(tensor, state, box): digest}); ranks from src_world up
    bring no state, and may be a step behind (recovery.py: they join empty-handed)."""
    sources = gathered[:src_world]
    steps = {rank: s for rank, (s, _, _) in enumerate(sources)}
    if set(steps.values()) != {step}:
        return f"the survivors holding the state stopped at steps {steps} (new rank: step), the order says {step}"
    samples = {rank: d for rank, (_, d, _) in enumerate(sources)}
    if len(set(samples.values())) != 1:
        return f"the survivors' data positions differ: {samples} (new rank: samples)"
    seen: dict = {}
    for rank, (_, _, digests) in enumerate(sources):
        for key, digest in digests.items():
            first = seen.setdefault(key, (rank, digest))
            if first[1] != digest:
                return f"replicas differ: tensor {key[0]} {key[1]} box {key[2]} on new ranks {first[0]} and {rank}"
    return None


def reporter_behind(old_steps: list[tuple[int, int]], step: int) -> bool:
    """Whether the old rank 0, the one that reported the job's steps, is among the survivors
    (old rank, step) a step behind `step`: it never reported the step the others completed."""
    return any(old == 0 and at < step for old, at in old_steps)


def recover(orphan: Orphan, order: protocol.JobRecoverOrder, settings):
    """Join the survivors' world and switch the state onto the order's layout. Returns
    (new rank, settings, shards, scalars, SwitchReport, marker, record), or None for a rank
    not in it; `record`: the StepResult of the order's step for the new rank 0 to report,
    when the old rank 0 stopped a step behind (else None).
    Under a device map that renumbers ranks, the new layout's world is formed with the new
    numbers, and the rank leaves its marker for its agent once its trainer is built
    (`renumbered`: the marker's name, or None)."""
    from parallelism.engine.digest import shard_digest
    from parallelism.engine.switch import switch_state
    from agents.runtime.worlds import join_world, rendezvous_store, renumbered_world

    import torch.distributed as dist

    moves = {m.old: m.new for m in order.ranks}
    process = moves.get(orphan.rank)
    if process is None:
        return None
    store = rendezvous_store(order.rendezvous, master=process == 0, timeout=settings.timeout_seconds)
    join_world(store, f"survivors-{order.restore_id}", process, order.union_world, settings.timeout_seconds)
    shards = orphan.shards if process < order.src_world else {}
    orphan.shards = {}
    digests = {(key[0], key[1], s.box): shard_digest(s) for key, s in shards.items()}
    gathered: list = [None] * order.union_world
    dist.all_gather_object(gathered, (orphan.rank, orphan.scalars.step, orphan.scalars.data.samples, digests))
    why = agreement([g[1:] for g in gathered], order.step, order.src_world)
    if why is not None:
        raise RecoveryError(f"restore {order.restore_id}: {why}")
    trained = orphan.trained
    record = trained if (process == 0 and trained is not None and trained.step == order.step
                         and reporter_behind([g[:2] for g in gathered], order.step)) else None
    new, scalars, report = switch_state(settings.tensors, shards, orphan.scalars, order.src_layout,
                                        order.layout, process, staging_bytes=order.staging_bytes,
                                        gpus_per_node=order.gpus_per_node, process_of=order.process_of)
    rank = process
    if report.renumbered:
        if not renumbered_world(store, f"layout-restore-{order.restore_id}", report.rank, order.world,
                                settings.timeout_seconds):
            return None
        rank = report.rank
    marker = renumbered_marker(recover_file(order.restore_id)) if report.renumbered else None
    return rank, replace(settings, restore_id=order.restore_id), new, scalars, report, marker, record
