"""Online resize of a running job (issue 6): plan the switch, place the joining ranks, and
send every involved node its JobSwitchOrder (agents/protocol.py).

Ranks keep their numbers across a switch (agents/runtime/worker.py): rank r below
min(old, new world) stays on its GPU, ranks from the old world size up are new processes
on newly allocated GPUs, ranks from the new world size up leave after handing their state
over. So only the joining ranks need GPUs, and a tensor-parallel group of the new layout
must fit the nodes where its staying ranks already are (rules in docs/elastic.md).

The GPU rows are locked as in job start (free GPUs of healthy nodes, in id order), so a
resize and a start never take the same GPU or rendezvous port. The reports that move the
transition on are applied in reports.py; commit and abort in transitions.py.
"""
from __future__ import annotations

import logging
from collections import defaultdict

from django.db import transaction

from agents import protocol
from agents.layout.allocate import AllocationError, FreeGpus, allocate
from agents.layout.catalog import get_model
from agents.layout.errors import LayoutError
from agents.layout.placement import Placement, batch_dp
from agents.layout.plan import PlanOptions, plan_routes
from agents.layout.spec import parse_layout
from controlplane.cluster.models import Node
from controlplane.cluster.selectors import gpus_lock_free, gpus_per_node
from controlplane.cluster.services import gpus_allocate
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.jobs import transitions
from controlplane.jobs.failures import send_orders_or_fail
from controlplane.jobs.layouts import STAGING_BYTES, batch_error, layout_for_resize
from controlplane.jobs.lifecycle import JobState, JobTrigger, TransitionState, job_next_state
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.orders import free_port, rendezvous_address, tp_block
from controlplane.jobs.services import layout_check, publish_job

log = logging.getLogger(__name__)

def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def place_joining(job: Job, dst: Placement, free: dict[str, list[int]]) -> list[dict]:
    """Slots {rank, node, gpu} of the joining ranks (old world .. new world - 1).

    The new layout's blocks of tp_block(dst) consecutive ranks must each sit on one node.
    A block whose ranks all stay must already be on one node (ranks never move). A block
    that straddles the old world size gets its joining ranks on the node of its staying
    ranks (that node's free GPUs in index order). The blocks made only of joining ranks go
    through agents.layout.allocate, which numbers ranks from 0: its slot i becomes rank
    first_joining_block + i, so its whole-block placement carries over. Conflict otherwise.
    `free` (node -> free GPU indices) loses the GPUs taken."""
    old = {slot["rank"]: slot for slot in job.placement}
    w0, w1 = job.world_size, dst.world
    block = tp_block(dst)
    joining: list[dict] = []
    for start in range(0, min(w0, w1), block):
        staying = list(range(start, min(start + block, w0, w1)))
        nodes = sorted({old[r]["node"] for r in staying})
        if len(nodes) > 1:
            raise Conflict(
                f"job {job.name!r} cannot switch to {dst.layout}: ranks {_span(list(range(start, start + block)))} "
                f"form one tensor-parallel block that must sit on one node, but ranks keep their GPUs in a resize "
                f"and ranks {_span(staying)} run on nodes {', '.join(nodes)}")
        wanted = list(range(max(start, w0), min(start + block, w1)))
        if wanted:
            node = nodes[0]
            have = sorted(free.get(node, []))
            if len(have) < len(wanted):
                raise Conflict(
                    f"job {job.name!r} cannot switch to {dst.layout}: joining ranks {_span(wanted)} must run on "
                    f"node {node} with ranks {_span(staying)} of their tensor-parallel block; it has {len(have)} "
                    f"free GPUs, {len(wanted)} needed")
            for rank, gpu in zip(wanted, have):
                joining.append({"rank": rank, "node": node, "gpu": gpu})
                free[node].remove(gpu)
    first = -(-w0 // block) * block
    if w1 > first:
        try:
            slots = allocate(w1 - first, block, [FreeGpus(node, tuple(gpus)) for node, gpus in sorted(free.items())])
        except AllocationError as exc:
            raise Conflict(f"job {job.name!r} cannot switch to {dst.layout}: joining ranks {_span(list(range(first, w1)))}"
                           f" cannot be placed: {exc}") from None
        for slot in slots:
            joining.append({"rank": first + slot.rank, "node": slot.node, "gpu": slot.gpu})
            free[slot.node].remove(slot.gpu)
    return sorted(joining, key=lambda s: s["rank"])


def job_resize(*, job_id: int, gpus: int | None = None, layout: str | None = None, requested_by=None) -> Transition:
    """POST /api/jobs/{id}/resize: plan the switch of a running job to `layout` (or the
    layout for `gpus` GPUs), allocate the joining ranks' GPUs, create the transition
    (planned), move the job running -> switching and, on commit, send every node that holds
    a staying, joining or leaving rank its JobSwitchOrder. InvalidInput (400) for a layout
    the model or the batch rejects; Conflict (409) for a job that is not running or has an
    active transition, or GPUs / ports that are not there."""
    if (gpus is None) == (layout is None):
        raise InvalidInput({"layout": ["give either `layout` or `gpus`, not both or neither"]})
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        active = transitions.active_transition(job)
        if active is not None:
            raise Conflict(f"a transition is already active: job {job.name!r} is switching {active.source_layout} -> "
                           f"{active.destination_layout} (transition {active.pk}, {active.state})")
        if job.state != JobState.RUNNING:
            raise Conflict(f"job {job.name!r} is {job.state}; only a running job can be resized")
        field = "layout" if layout is not None else "gpus"
        if layout is None:
            layout = layout_for_resize(job, gpus)
        try:
            text = str(parse_layout(layout))
        except LayoutError as exc:
            raise InvalidInput({"layout": [str(exc)]}) from None
        dst = layout_check(model=job.model, layout=text)
        if gpus is not None and dst.world != gpus:
            raise InvalidInput({"gpus": [f"layout {text} spans {dst.world} GPUs, not {gpus}"]})
        error = batch_error(job, text, batch_dp(dst))
        if error:
            raise InvalidInput({"global_batch": [error]})
        if text == job.layout:
            raise Conflict(f"job {job.name!r} already runs {text} on {job.world_size} GPUs; nothing to switch")

        free_rows = gpus_lock_free()
        per_node = gpus_per_node()
        try:
            plan = plan_routes(get_model(job.model), job.layout, text,
                               PlanOptions(gpus_per_node=per_node, staging_bytes=STAGING_BYTES))
        except LayoutError as exc:
            raise InvalidInput({"layout": [f"the switch {job.layout} -> {text} cannot be planned: {exc}"]}) from None
        free: dict[str, list[int]] = defaultdict(list)
        for gpu in free_rows:
            free[gpu.node.name].append(gpu.index)
        joining = place_joining(job, dst, free)
        rows = {(gpu.node.name, gpu.index): gpu for gpu in free_rows}
        gpus_allocate(gpus=[rows[(slot["node"], slot["gpu"])] for slot in joining], job=job)
        port = free_port()
        rank0 = next(slot for slot in job.placement if slot["rank"] == 0)
        host = Node.objects.get(name=rank0["node"]).host
        old = sorted(job.placement, key=lambda s: s["rank"])
        who = f" by {requested_by}" if requested_by is not None and getattr(requested_by, "pk", None) else ""
        summary = plan.summary()
        new = Transition.objects.create(
            job=job, source_layout=job.layout, destination_layout=text, source_world=job.world_size,
            destination_world=dst.world,
            reason=f"resize to {gpus} GPUs ({text}){who}" if field == "gpus" else f"resize to {text}{who}",
            plan_summary=summary, plan_fingerprint=plan.fingerprint, source_placement=old,
            destination_placement=[s for s in old if s["rank"] < dst.world] + joining,
            rendezvous=rendezvous_address(host, port), rendezvous_port=port, gpus_per_node=per_node, staging_bytes=STAGING_BYTES,
            peak_staging_bytes=summary.get("peak_staging_bytes"),
        )
        transitions.enter(new, TransitionState.PLANNED, reported=False, at=new.created_at)
        new.save(update_fields=["history", "state"])
        job.state = job_next_state(JobState.RUNNING, JobTrigger.SWITCH)
        job.save(update_fields=["state", "updated_at"])
        publish_job(job, "upsert")
        transitions.publish_transition(new)
        orders = switch_orders(job, new)
        transaction.on_commit(lambda: _send_switches(job.pk, orders))
    log.info("job %s: transition %s planned, %s -> %s (plan %s)", job.name, new.pk, new.source_layout,
             new.destination_layout, new.plan_fingerprint[:12])
    return new


def switch_orders(job: Job, transition: Transition) -> dict[str, protocol.JobSwitchOrder]:
    """One order per node holding a staying, joining or leaving rank: the same order
    except `ranks`, that node's slots in the union world (its old slots and its joining ones)."""
    union = {slot["rank"]: slot for slot in transition.source_placement}
    union.update({slot["rank"]: slot for slot in transition.destination_placement})
    slots: dict[str, list[protocol.RankSlot]] = defaultdict(list)
    for rank in sorted(union):
        slot = union[rank]
        slots[slot["node"]].append(protocol.RankSlot(rank=rank, gpu=slot["gpu"]))
    return {node: protocol.JobSwitchOrder(
        job_id=job.pk, transition_id=transition.pk, job_name=job.name, model=job.model,
        global_batch=job.global_batch, micro_batch=job.micro_batch, seq=job.seq_len, max_steps=job.max_steps,
        src_layout=transition.source_layout, src_world=transition.source_world, layout=transition.destination_layout,
        world=transition.destination_world, rendezvous=transition.rendezvous, ranks=tuple(ranks),
        staging_bytes=transition.staging_bytes, gpus_per_node=transition.gpus_per_node,
        checkpoint_interval=job.checkpoint_interval, checkpoint_dir=job.checkpoint_dir, restore_id=job.restore_id)
        for node, ranks in slots.items()}


def _send_switches(job_id: int, orders: dict[str, protocol.JobSwitchOrder]) -> None:
    if orders:
        tid = next(iter(orders.values())).transition_id
        send_orders_or_fail(job_id, protocol.NODE_JOB_SWITCH, orders, f"the switch order of transition {tid}")
