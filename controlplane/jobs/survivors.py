"""Switch a job onto its surviving ranks without a checkpoint (docs/elastic.md, "Failures
and recovery"): called by restore.job_restore when parallelism.layout.recovery says they may.

The survivors are processes that outlived their world and keep their state. They meet at
a fresh rendezvous (the old store may have died with rank 0's node) renumbered 0..n-1
(whole replicas first: they hold the rule's source layout), and the engine switches them,
under the plan's device map (which survivor takes which new rank), onto the target layout
for their GPUs: the resize rule's layout for n GPUs when the model,
the batch and the nodes allow it (TP groups on one node), else the source layout itself.
A `restore` row records it; rank 0's `committed` report fills in the engine's timings and
digest verification.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import replace

from django.db import transaction
from django.utils import timezone

from agents import protocol
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import batch_dp, tp_block
from parallelism.planner.plan import PlanOptions, plan_routes
from parallelism.layout.recovery import SurvivorWorld
from controlplane.cluster.models import Gpu, Node
from controlplane.cluster.selectors import gpus_per_node
from controlplane.cluster.services import gpus_release
from controlplane.common import inputs
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.jobs import transitions
from controlplane.jobs.failures import send_orders_or_fail
from controlplane.jobs.layouts import STAGING_BYTES, batch_error, layout_for_resize
from controlplane.jobs.lifecycle import JobState, JobTrigger, TransitionKind, job_next_state
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.orders import free_port, rendezvous_address, stop_on_commit
from controlplane.jobs.services import layout_check, publish_job

log = logging.getLogger(__name__)


def _spans_nodes(nodes: list[str], process_of, world: int, block: int) -> bool:
    """Would a tensor-parallel block of the new layout span nodes? Rank d runs where process
    process_of[d] (d itself without a map) runs: nodes[process]."""
    where = [nodes[d if process_of is None else int(process_of[d])] for d in range(world)]
    return any(len(set(where[b:b + block])) > 1 for b in range(0, world, block))


def _target(job: Job, world: SurvivorWorld, nodes: list[str]) -> tuple[str, object] | str:
    """(layout, plan) the survivors switch onto, or why none works. nodes[process] is where
    each renumbered survivor runs. The plan has the best device map whose tensor-parallel
    blocks sit on one node each, else the survivors' own order."""
    why = []
    model = inputs.model_of(job.model)
    for text in dict.fromkeys([layout_for_resize(job, len(nodes), model), world.source_layout]):
        try:
            placement = layout_check(model=model, layout=text)
        except InvalidInput as exc:
            why.append(f"{text}: {exc}")
            continue
        error = batch_error(job, text, batch_dp(placement))
        block = tp_block(placement)
        if placement.world > len(nodes):
            error = f"{text} spans {placement.world} GPUs, the survivors have {len(nodes)}"
        elif _spans_nodes(nodes, None, placement.world, block):
            error = f"{text}: a tensor-parallel group of {block} ranks would span nodes"
        if error:
            why.append(error)
            continue
        try:
            options = PlanOptions(gpus_per_node=gpus_per_node(), staging_bytes=STAGING_BYTES)
            plan = plan_routes(model, world.source_layout, text, replace(options, map_ranks=True))
            if plan.process_of is not None and _spans_nodes(nodes, plan.process_of, placement.world, block):
                plan = plan_routes(model, world.source_layout, text, options)
        except LayoutError as exc:
            why.append(f"{world.source_layout} -> {text} cannot be planned: {exc}")
            continue
        return text, plan
    return "; ".join(why)


def survivors_switch(job: Job, world: SurvivorWorld, *, step: int, cause: str) -> Transition | str:
    """The locked restoring job goes on on its survivors: restore row, new placement and
    rendezvous, JobRecoverOrders on commit (restoring -> starting). Returns the row, or why
    the survivors cannot run it (the caller then restores from a checkpoint or fails)."""
    slot_of = {slot["rank"]: slot for slot in job.placement}
    union = [{"rank": new, "node": slot_of[old]["node"], "gpu": slot_of[old]["gpu"]} for old, new in world.ranks]
    union.sort(key=lambda s: s["rank"])
    chosen = _target(job, world, [s["node"] for s in union])
    if isinstance(chosen, str):
        return chosen
    layout, plan = chosen
    target_world = plan.dst.world
    process_of = None if plan.process_of is None else [int(p) for p in plan.process_of]
    placement = [{**union[d if process_of is None else process_of[d]], "rank": d} for d in range(target_world)]
    # The engine's union world: the source's ranks and the target's; other survivors leave.
    moves = [(old, new) for old, new in world.ranks if new < max(world.source_world, target_world)]
    host = Node.objects.get(name=placement[0]["node"]).host
    try:
        port = free_port(host)
    except Conflict as exc:
        return str(exc)
    rendezvous = rendezvous_address(host, port)
    kept = {(s["node"], s["gpu"]) for s in placement}
    gpus_release(gpus=Gpu.objects.filter(job=job).exclude(
        pk__in=[g.pk for g in Gpu.objects.filter(job=job).select_related("node") if (g.node.name, g.index) in kept]))
    olds = [old for old, _ in world.ranks]
    reason = (f"{cause} at step {step}; switched on the survivors without a checkpoint (no step redone): ranks "
              f"{', '.join(f'{old}->{new}' for old, new in moves)} held {world.source_layout}, switched to "
              f"{layout} on {target_world} GPUs")
    summary = plan.summary()
    row = Transition.objects.create(
        job=job, kind=TransitionKind.RESTORE, source_layout=job.layout, destination_layout=layout,
        source_world=job.world_size, destination_world=target_world, source_placement=job.placement,
        destination_placement=placement, process_of=process_of, rendezvous=rendezvous, step=step, reason=reason,
        plan_summary=summary, plan_fingerprint=plan.fingerprint, gpus_per_node=plan.options.gpus_per_node, staging_bytes=STAGING_BYTES,
        peak_staging_bytes=summary.get("peak_staging_bytes"),
        history=[{"state": "planned", "at": timezone.now().isoformat(), "reported": False}],
        verification={"survivors": {"ranks": [list(pair) for pair in moves],
                                    "source_layout": world.source_layout, "step": step,
                                    # the world the survivors come from: its late step reports
                                    # up to `step` still belong to the job (reports.refusal)
                                    "source_restore": job.restore_id}})
    old_nodes = list(dict.fromkeys([*job.nodes, *(slot_of[r]["node"] for r in olds)]))
    job.placement, job.layout, job.world_size = placement, layout, target_world
    job.rendezvous, job.rendezvous_port = rendezvous, port
    job.restore_id, job.error, job.recovery = row.pk, "", {}
    job.state = job_next_state(JobState.RESTORING, JobTrigger.RESTART)
    job.save()
    publish_job(job, "upsert")
    transitions.publish_transition(row)
    by_node: dict[str, list[protocol.RankMove]] = defaultdict(list)
    for old, new in moves:
        by_node[slot_of[old]["node"]].append(protocol.RankMove(old=old, new=new))
    orders = {node: protocol.JobRecoverOrder(
        job_id=job.pk, restore_id=row.pk, step=step, rendezvous=rendezvous, src_layout=world.source_layout,
        src_world=world.source_world, layout=layout, world=target_world, union_world=len(moves),
        ranks=tuple(here), staging_bytes=STAGING_BYTES, gpus_per_node=row.gpus_per_node,
        process_of=None if process_of is None else tuple(process_of))
        for node, here in by_node.items()}
    stop_on_commit(job, [n for n in old_nodes if n not in orders])
    transaction.on_commit(lambda: _send_recovers(job.pk, orders))
    log.warning("job %s: %s", job.name, reason)
    return row


def _send_recovers(job_id: int, orders: dict[str, protocol.JobRecoverOrder]) -> None:
    restore_id = next(iter(orders.values())).restore_id
    send_orders_or_fail(job_id, protocol.NODE_JOB_RECOVER, orders, f"the recovery order of restore {restore_id}")
