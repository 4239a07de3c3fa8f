"""Online resize of a running job (issue 6): plan the switch, place the joining processes,
and send every involved node its JobSwitchOrder (agents/protocol.py).

The switch runs on the union world (agents/runtime/worker.py): process p below the old
world size is the job's rank p on its GPU, processes from the old world size up are new
ones on newly allocated GPUs. The plan's device map (parallelism/planner/rank_map.py) chooses
which process takes which new rank so that the fewest bytes cross the network (rank 0
stays on process 0); processes that take no rank leave after handing their state over.
So only the joining processes need GPUs, and a tensor-parallel group of the new layout
must fit the node of the processes the map gives it (rules in docs/elastic.md).

The GPU rows are locked as in job start (free GPUs of healthy nodes, in id order), so a
resize and a start never take the same GPU or rendezvous port. The reports that move the
transition on are applied in reports.py; commit and abort in transitions.py.
"""
from __future__ import annotations

import logging
from collections import defaultdict

from django.db import transaction

from parallelism.layout.allocate import AllocationError, FreeGpus, allocate
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import Placement, batch_dp, place, tp_block
from parallelism.planner.plan import PlanOptions, plan_routes
from parallelism.layout.spec import parse_layout
from controlplane.cluster.models import Node
from controlplane.cluster.selectors import gpus_per_node, gpus_take
from controlplane.cluster.services import gpus_allocate
from controlplane.common import inputs
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.jobs import transitions
from controlplane.jobs.layouts import STAGING_BYTES, batch_error, layout_for_resize
from controlplane.jobs.lifecycle import RESIZABLE_JOB_STATES, JobState, JobTrigger, TransitionState, job_next_state
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.orders import free_port, rendezvous_address
from controlplane.jobs.preflight import switch_when_checked
from controlplane.jobs.services import layout_check, publish_job

log = logging.getLogger(__name__)

def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def place_joining(job: Job, dst: Placement, free: dict[str, list[int]], process_of=None) -> list[dict]:
    """Slots {rank: the process, node, gpu} of the joining processes (old world .. union - 1).

    `process_of[d]`: the process that takes new rank d (None: process d). The new layout's
    blocks of tp_block(dst) consecutive ranks must each sit on one node; a device map puts
    a block on an aligned block of processes. A process block of old processes only must
    already be on one node (processes never move). A block that straddles the old world
    size gets its joining processes on the node of its old ones (that node's free GPUs in
    index order). The blocks of joining processes only go through parallelism.layout.allocate,
    which numbers slots from 0: its slot i becomes process first_joining_block + i, so its
    whole-block placement carries over. Conflict otherwise. `free` (node -> free GPU
    indices) loses the GPUs taken."""
    old = {slot["rank"]: slot for slot in job.placement}
    w0, w1 = job.world_size, dst.world
    block = tp_block(dst)
    process = list(range(w1)) if process_of is None else [int(p) for p in process_of]
    joining: list[dict] = []
    for d in range(0, w1, block):
        start = process[d] // block * block
        if start >= w0:
            continue
        staying = list(range(start, min(start + block, w0)))
        nodes = sorted({old[p]["node"] for p in staying})
        if len(nodes) > 1:
            raise Conflict(
                f"job {job.name!r} cannot switch to {dst.layout}: new ranks {_span(list(range(d, d + block)))} "
                f"form one tensor-parallel block that must sit on one node, but they go to the GPUs of ranks "
                f"{_span(staying)} (ranks keep their GPUs in a resize) and ranks {_span(staying)} run on nodes "
                f"{', '.join(nodes)}")
        wanted = list(range(max(start, w0), min(start + block, w1)))  # (none when shrinking)
        if wanted:
            node = nodes[0]
            have = sorted(free.get(node, []))
            if len(have) < len(wanted):
                new_ranks = [d + p - start for p in wanted]
                raise Conflict(
                    f"job {job.name!r} cannot switch to {dst.layout}: joining ranks {_span(new_ranks)} must run on "
                    f"node {node} with ranks {_span(staying)} of their tensor-parallel block; it has {len(have)} "
                    f"free GPUs, {len(wanted)} needed")
            for p, gpu in zip(wanted, have):
                joining.append({"rank": p, "node": node, "gpu": gpu})
                free[node].remove(gpu)
    first = -(-w0 // block) * block
    if w1 > first:
        try:
            slots = allocate(w1 - first, block, [FreeGpus(node, tuple(gpus)) for node, gpus in sorted(free.items())])
        except AllocationError as exc:
            new_ranks = [d for d, p in enumerate(process) if p >= first]
            raise Conflict(f"job {job.name!r} cannot switch to {dst.layout}: joining ranks {_span(new_ranks)} "
                           f"cannot be placed: {exc}") from None
        for slot in slots:
            joining.append({"rank": first + slot.rank, "node": slot.node, "gpu": slot.gpu})
            free[slot.node].remove(slot.gpu)
    return sorted(joining, key=lambda s: s["rank"])


def destination_slots(job: Job, joining: list[dict], world: int, process_of=None) -> list[dict]:
    """Where each of the `world` new ranks runs: on the GPU of the process the map gives it."""
    of_process = {slot["rank"]: slot for slot in (*job.placement, *joining)}
    out = []
    for d in range(world):
        slot = of_process[d if process_of is None else int(process_of[d])]
        out.append({"rank": d, "node": slot["node"], "gpu": slot["gpu"]})
    return out


def job_resize(*, job_id: int, gpus: int | None = None, layout: str | None = None, requested_by=None,
               reason: str | None = None) -> Transition:
    """POST /api/jobs/{id}/resize: plan the switch of a running job to `layout` (or the
    layout for `gpus` GPUs), allocate the joining ranks' GPUs, create the transition
    (planned), move the job running -> switching and, on commit, send every node that holds
    a staying, joining or leaving rank its JobSwitchOrder. InvalidInput (400) for a layout
    the model or the batch rejects; Conflict (409) for a job that is not running or has an
    active transition, or GPUs / ports that are not there. `reason`: why, for the layout
    history (the elastic scheduler's decision); default: what was asked, and by whom."""
    if (gpus is None) == (layout is None):
        raise InvalidInput({"layout": ["give either `layout` or `gpus`, not both or neither"]})
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        active = transitions.active_transition(job)
        if active is not None:
            raise Conflict(f"a transition is already active: job {job.name!r} is switching {active.source_layout} -> "
                           f"{active.destination_layout} (transition {active.pk}, {active.state})")
        if job.state not in RESIZABLE_JOB_STATES:
            raise Conflict(f"job {job.name!r} is {job.state}; only a running job can be resized")
        field = "layout" if layout is not None else "gpus"
        model = inputs.model_of(job.model)  # resolved once for every check and the plan below
        if layout is None:
            layout = layout_for_resize(job, gpus, model)
        try:
            text = str(parse_layout(layout))
        except LayoutError as exc:
            raise InvalidInput({"layout": [str(exc)]}) from None
        dst = layout_check(model=model, layout=text)
        if gpus is not None and dst.world != gpus:
            raise InvalidInput({"gpus": [f"layout {text} spans {dst.world} GPUs, not {gpus}"]})
        error = batch_error(job, text, batch_dp(dst))
        if error:
            raise InvalidInput({"global_batch": [error]})
        if text == job.layout:
            raise Conflict(f"job {job.name!r} already runs {text} on {job.world_size} GPUs; nothing to switch")
        inputs.plan_world_check(place(model, job.layout), dst, field)

        per_node = gpus_per_node()
        try:
            plan = plan_routes(model, job.layout, text,
                               PlanOptions(gpus_per_node=per_node, staging_bytes=STAGING_BYTES, map_ranks=True))
        except LayoutError as exc:
            raise InvalidInput({"layout": [f"the switch {job.layout} -> {text} cannot be planned: {exc}"]}) from None
        process_of = None if plan.process_of is None else [int(p) for p in plan.process_of]

        def choose(free: dict[str, list[int]]):
            slots = place_joining(job, dst, defaultdict(list, free), process_of)
            return slots, [(slot["node"], slot["gpu"]) for slot in slots]

        joining, rows = gpus_take(choose)
        gpus_allocate(gpus=[rows[(slot["node"], slot["gpu"])] for slot in joining], job=job)
        rank0 = next(slot for slot in job.placement if slot["rank"] == 0)
        host = Node.objects.get(name=rank0["node"]).host
        port = free_port(host)
        old = sorted(job.placement, key=lambda s: s["rank"])
        who = f" by {requested_by}" if requested_by is not None and getattr(requested_by, "pk", None) else ""
        if reason is None:
            reason = f"resize to {gpus} GPUs ({text}){who}" if field == "gpus" else f"resize to {text}{who}"
        summary = plan.summary()
        new = Transition.objects.create(
            job=job, source_layout=job.layout, destination_layout=text, source_world=job.world_size,
            destination_world=dst.world,
            reason=reason,
            plan_summary=summary, plan_fingerprint=plan.fingerprint, source_placement=old,
            destination_placement=destination_slots(job, joining, dst.world, process_of), process_of=process_of,
            rendezvous=rendezvous_address(host, port), rendezvous_port=port, gpus_per_node=per_node, staging_bytes=STAGING_BYTES,
            peak_staging_bytes=summary.get("peak_staging_bytes"),
        )
        transitions.enter(new, TransitionState.PLANNED, reported=False, at=new.created_at)
        new.save(update_fields=["history", "state"])
        job.state = job_next_state(JobState.RUNNING, JobTrigger.SWITCH)
        job.save(update_fields=["state", "updated_at"])
        publish_job(job, "upsert")
        transitions.publish_transition(new)
        switch_when_checked(job, new)
    log.info("job %s: transition %s planned, %s -> %s (plan %s)", job.name, new.pk, new.source_layout,
             new.destination_layout, new.plan_fingerprint[:12])
    return new
