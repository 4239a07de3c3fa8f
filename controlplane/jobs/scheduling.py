"""Jobs on the node agents: allocate GPUs, pick a rendezvous, send start and stop orders,
fail jobs whose node is lost.

Allocation is race-free: the free GPU rows of healthy nodes are locked (SELECT ... FOR
UPDATE, in id order) before allocate() chooses among them, so a second scheduler waits and
then sees them allocated. Orders leave after commit, one per node, on that node's queue.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from math import lcm

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from kombu.exceptions import OperationalError

from agents import protocol
from agents.layout.allocate import AllocationError, FreeGpus, allocate
from agents.layout.placement import Placement, batch_dp
from controlplane.cluster.events import GROUP as CLUSTER_GROUP
from controlplane.cluster.events import STREAM as CLUSTER_STREAM
from controlplane.cluster.events import GpuEvent
from controlplane.cluster.lifecycle import GpuState, GpuTrigger, NodeState, gpu_next_state
from controlplane.cluster.models import Gpu
from controlplane.cluster.selectors import gpu_view
from controlplane.cluster.services import gpus_release
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.jobs import transitions
from controlplane.jobs.lifecycle import (LIVE_JOB_STATES, TERMINAL_TRANSITION_STATES, JobState, JobTrigger,
                                        TransitionKind, TransitionState, job_next_state)
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.restore import no_restore_reason, restore_begin
from controlplane.jobs.resume import is_resume, resume_row
from controlplane.jobs.services import job_create, layout_check, publish_job

log = logging.getLogger(__name__)


def rendezvous_ports() -> range:
    """DYNAPLANE_RENDEZVOUS_PORTS, "first-last" (inclusive)."""
    text = settings.DYNAPLANE_RENDEZVOUS_PORTS
    first, sep, last = text.partition("-")
    try:
        ports = range(int(first), int(last if sep else first) + 1)
    except ValueError:
        ports = range(0)
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise ImproperlyConfigured(f"DYNAPLANE_RENDEZVOUS_PORTS={text!r} is not a port range like 29400-29599")
    return ports


def tp_block(placement: Placement) -> int:
    """Ranks that must share a node: every module's TP groups (tp consecutive ranks from its
    offset) fit in aligned blocks of lcm(tp). E.g. encoder tp=2 + llm tp=4 -> blocks of 4.
    When a module's offset breaks the alignment, the whole job goes on one node."""
    modules = placement.modules.values()
    block = lcm(*(ml.tp for ml in modules))
    if placement.world % block or any(ml.offset % ml.tp for ml in modules):
        return placement.world
    return block


def job_submit(*, start: bool = True, **fields) -> Job:
    """POST /api/jobs: create the job and, when `start`, schedule it, all or nothing."""
    with transaction.atomic():
        job = job_create(**fields)
        if start:
            job = job_start(job_id=job.pk)
    return job


def job_start(*, job_id: int) -> Job:
    """pending -> starting: allocate GPUs, store the placement and rendezvous, and on commit
    send each node its JobStartOrder. Conflict (409) when the GPUs or ports are not there."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.state != JobState.PENDING:
            raise Conflict(f"job {job.name!r} is {job.state}; only a pending job can be started")
        placement = layout_check(model=job.model, layout=job.layout)
        dp = batch_dp(placement)
        if job.global_batch % (job.micro_batch * dp):
            raise InvalidInput({"global_batch": [
                f"global_batch={job.global_batch} is not a multiple of micro_batch={job.micro_batch} x dp={dp}"]})
        free = list(Gpu.objects.select_for_update(of=("self",)).select_related("node")
                    .filter(state=GpuState.FREE, job__isnull=True, node__state=NodeState.HEALTHY).order_by("id"))
        by_node: dict[str, list[int]] = defaultdict(list)
        for gpu in free:
            by_node[gpu.node.name].append(gpu.index)
        try:
            slots = allocate(placement.world, tp_block(placement),
                             [FreeGpus(node, tuple(indices)) for node, indices in by_node.items()])
        except AllocationError as exc:
            raise Conflict(f"job {job.name!r} ({job.layout}) cannot be placed: {exc}") from None
        gpus = {(gpu.node.name, gpu.index): gpu for gpu in free}
        for slot in slots:
            gpu = gpus[(slot.node, slot.gpu)]
            gpu.job, gpu.state = job, gpu_next_state(GpuState(gpu.state), GpuTrigger.ALLOCATE)
            gpu.save(update_fields=["job", "state"])
            publish_on_commit(CLUSTER_GROUP, GpuEvent(seq=next_seq(CLUSTER_STREAM), gpu=gpu_view(gpu)))
        host = gpus[(slots[0].node, slots[0].gpu)].node.host
        port = _free_port()
        job.placement = [{"rank": s.rank, "node": s.node, "gpu": s.gpu} for s in slots]
        job.rendezvous = f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
        job.rendezvous_port = port
        job.error = ""
        if is_resume(job):  # its ranks load the checkpoint (restore_from) and commit this row
            row = resume_row(job)
            job.restore_id = row.pk
            transitions.publish_transition(row)
        job.state = job_next_state(JobState.PENDING, JobTrigger.START)
        job.save()
        publish_job(job, "upsert")
        for node, order in start_orders(job).items():
            transaction.on_commit(lambda node=node, order=order: _send_start(job.pk, node, order))
    return job


def _free_port() -> int:
    """The lowest port of the range that no live job uses and no active transition (a
    resize's union world) uses. Called with the free GPU rows locked, so two schedulers
    never read the same set (and unique constraints back this up within each table).

    A live job keeps every port it has had: its rank 0 process served the start store and
    each switch's union store, and torch keeps a store's socket open as long as anything in
    the process refers to it (measured: the start port was still bound after two switches,
    and a resize given it failed with EADDRINUSE). The ports come back when the job ends."""
    ports = rendezvous_ports()
    used = set(Job.objects.filter(state__in=LIVE_JOB_STATES, rendezvous_port__isnull=False)
               .values_list("rendezvous_port", flat=True))
    used |= set(Transition.objects.exclude(state__in=[s.value for s in TERMINAL_TRANSITION_STATES])
                .filter(rendezvous_port__isnull=False).values_list("rendezvous_port", flat=True))
    used |= set(Transition.objects.filter(job__state__in=LIVE_JOB_STATES, rendezvous_port__isnull=False)
                .values_list("rendezvous_port", flat=True))
    for port in ports:
        if port not in used:
            return port
    raise Conflict(f"all {len(ports)} rendezvous ports {ports.start}-{ports.stop - 1} are used by live jobs "
                   f"and active transitions")


def start_orders(job: Job) -> dict[str, protocol.JobStartOrder]:
    """One order per node of the job: the same job fields, that node's ranks only."""
    slots: dict[str, list[protocol.RankSlot]] = defaultdict(list)
    for slot in job.placement:
        slots[slot["node"]].append(protocol.RankSlot(rank=slot["rank"], gpu=slot["gpu"]))
    return {node: protocol.JobStartOrder(
        job_id=job.pk, job_name=job.name, model=job.model, layout=job.layout, world=job.world_size,
        global_batch=job.global_batch, micro_batch=job.micro_batch, seq=job.seq_len, rendezvous=job.rendezvous,
        ranks=tuple(ranks), max_steps=job.max_steps, checkpoint_interval=job.checkpoint_interval,
        checkpoint_dir=job.checkpoint_dir, restore_id=job.restore_id,
        restore_from=job.checkpoint_path if job.restore_id else "") for node, ranks in slots.items()}


def _send(task: str, node: str,
          order: protocol.JobStartOrder | protocol.JobStopOrder | protocol.JobSwitchCancel
          | protocol.JobRecoverOrder) -> None:
    from controlplane.celery import app

    app.send_task(task, args=[order.model_dump(mode="json")], queue=protocol.node_queue(node))


def _send_start(job_id: int, node: str, order: protocol.JobStartOrder) -> None:
    """After commit. A broker that refuses the order fails the job (its other nodes are
    told to stop) rather than leaving it starting for ever."""
    try:
        _send(protocol.NODE_JOB_START, node, order)
    except (OperationalError, OSError) as exc:
        log.error("job %s: start order to node %s not sent: %s", job_id, node, exc)
        job_fail(job_id=job_id, error=f"the start order to node {node} could not be sent: {exc}")


def send_orders_or_fail(job_id: int, task: str, orders: dict, what: str) -> None:
    """After commit: each node its order. A broker that refuses one fails the job: some
    nodes may have got theirs, and there is no order that takes them back."""
    for node, order in orders.items():
        try:
            _send(task, node, order)
        except (OperationalError, OSError) as exc:
            log.error("job %s: %s to node %s not sent: %s", job_id, what, node, exc)
            job_fail(job_id=job_id, error=f"{what} to node {node} could not be sent: {exc}")
            return


def _send_stops(job_id: int, nodes: list[str]) -> None:
    for node in nodes:
        try:
            _send(protocol.NODE_JOB_STOP, node, protocol.JobStopOrder(job_id=job_id))
        except (OperationalError, OSError) as exc:  # the agent's ranks time out at the rendezvous/collectives
            log.error("job %s: stop order to node %s not sent: %s", job_id, node, exc)


def stop_on_commit(job: Job, nodes: list[str]) -> None:
    if nodes:
        transaction.on_commit(lambda: _send_stops(job.pk, list(nodes)))


def job_stop(*, job_id: int) -> Job:
    """A pending job stops at once; a live one goes stopping and every node of it gets a
    JobStopOrder (asked again while stopping, the orders are sent again). Else Conflict."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        state = JobState(job.state)
        if state is JobState.RESTORING:  # no world trains; the restore task finds it stopped
            nodes = transitions.job_nodes(job) + [g.node.name for g in job.gpus.select_related("node")]
            job_finish(job, state=job_next_state(state, JobTrigger.STOP))
            stop_on_commit(job, list(dict.fromkeys(nodes)))
            return job
        if state is not JobState.STOPPING:
            if state is not JobState.PENDING and state not in LIVE_JOB_STATES:
                raise Conflict(f"job {job.name!r} is {job.state}; only a pending or live job can be stopped")
            job.state = job_next_state(state, JobTrigger.STOP)
            job.save(update_fields=["state", "updated_at"])
            publish_job(job, "upsert")
        stop_on_commit(job, transitions.job_nodes(job) if job.state == JobState.STOPPING else [])
    return job


def job_finish(job: Job, *, state: JobState, error: str = "") -> None:
    """Move a locked live job to stopped or failed and free its GPUs (lost ones stay lost).
    An active transition of the job ends aborted first (transitions.end_with_job)."""
    transitions.end_with_job(job, state=state, error=error)
    job.state = state
    if error:
        job.error = error
    job.save(update_fields=["state", "error", "updated_at"])
    gpus_release(gpus=Gpu.objects.filter(job=job))
    publish_job(job, "upsert")


def job_fail(*, job_id: int, error: str, notify: list[str] | None = None) -> Job | None:
    """Fail a live job, release its GPUs and tell its nodes (`notify`, default all, the nodes
    of joining ranks during a transition included) to stop."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.state not in LIVE_JOB_STATES:
            return job
        nodes = transitions.job_nodes(job) if notify is None else notify
        job_finish(job, state=job_next_state(JobState(job.state), JobTrigger.FAIL), error=error)
        stop_on_commit(job, nodes)
    return job


def _abort_switch_of_lost_joiners(job_id: int, lost: set[str]) -> bool:
    """A lost node that holds only ranks joining a resize: the job is spared. Before the
    state moves, the resize is aborted here (the job's ranks never left their layout) and
    rank 0 is told to drop it; once it moves, the ranks roll back and report it. True when
    the job was spared."""
    job = Job.objects.select_for_update().get(pk=job_id)
    active = transitions.active_transition(job, lock=True)
    if active is None or active.kind != TransitionKind.RESIZE or any(slot["node"] in lost for slot in job.placement):
        return False
    if active.state in (TransitionState.READY, TransitionState.TRANSFERRING, TransitionState.VERIFYING):
        # The old ranks are all alive and keep their state until the commit point: the
        # switch fails on the ranks and rank 0 reports rolled_back (or, if the switch had
        # finished, committed, and a later failure report fails the job).
        log.warning("job %s: node %s with joining ranks lost while transition %s is %s; the ranks roll back",
                    job.name, ", ".join(sorted(lost)), active.pk, active.state)
        return True
    if active.state not in (TransitionState.PLANNED, TransitionState.PREPARING):
        return False
    joining = sorted(s["rank"] for s in active.destination_placement
                     if s["node"] in lost and s["rank"] >= active.source_world)
    transitions.enter(active, TransitionState.ABORTED, reported=False)
    why = (f"node {', '.join(sorted(lost))} (joining ranks {', '.join(map(str, joining))}) lost before the "
           f"transfer; the job trains on in {job.layout}")
    active.reason = f"{active.reason}; {why}" if active.reason else why
    active.save()
    transitions.undo(job, active)
    transitions.publish_transition(active)
    log.warning("job %s: transition %s aborted: %s", job.name, active.pk, why)
    send_cancels_on_commit(job, sorted({slot["node"] for slot in job.placement}),
                           protocol.JobSwitchCancel(job_id=job.pk, transition_id=active.pk, reason=why))
    return True


def send_cancels_on_commit(job: Job, nodes: list[str], cancel: protocol.JobSwitchCancel) -> None:
    """After commit, tell these nodes to drop the switch (joining ranks stopped, rank 0 told)."""
    nodes = list(nodes)
    transaction.on_commit(lambda: _send_cancels(job.pk, nodes, cancel))


def _send_cancels(job_id: int, nodes: list[str], cancel: protocol.JobSwitchCancel) -> None:
    for node in nodes:
        try:
            _send(protocol.NODE_JOB_SWITCH_CANCEL, node, cancel)
        except (OperationalError, OSError) as exc:  # rank 0 then abandons the switch on its own timeout
            log.error("job %s: switch cancel to node %s not sent: %s", job_id, node, exc)


def jobs_fail_on_node_loss(*, nodes: list[str]) -> list[int]:
    """Called where nodes are marked lost, in that transaction: every live job with ranks on
    them restarts from its latest checkpoint on the GPUs it has left (restore.py), or,
    without one, fails. Returns the ids of the jobs that failed."""
    lost = set(nodes)
    ids = sorted(set(Gpu.objects.filter(node__name__in=lost, job__state__in=LIVE_JOB_STATES)
                     .values_list("job_id", flat=True)))
    spared = [job_id for job_id in ids if _abort_switch_of_lost_joiners(job_id, lost)]
    ids = [job_id for job_id in ids if job_id not in spared]
    restored: list[int] = []
    for job_id in ids:
        job = Job.objects.get(pk=job_id)
        active = transitions.active_transition(job)
        slots = {(s["rank"], s["node"]) for s in job.placement}
        if active is not None:  # the joining ranks of a resize count as well
            slots |= {(s["rank"], s["node"]) for s in active.destination_placement}
        ranks = defaultdict(list)
        for rank, node in sorted(slots):
            if node in lost:
                ranks[node].append(rank)
        where = "; ".join(f"node {node} (ranks {', '.join(map(str, r))})" for node, r in sorted(ranks.items()))
        where = where or "node " + ", ".join(sorted(lost))
        locked = Job.objects.select_for_update().get(pk=job_id)
        if restore_begin(locked, cause=f"{where} lost", known_lost=True, lost_nodes=lost):
            restored.append(job_id)
            continue
        why = no_restore_reason(locked) or f"the job was {locked.state}"
        job_fail(job_id=job_id, error=f"{where} lost: its heartbeats stopped while it ran this job's ranks; {why}")
    ids = [job_id for job_id in ids if job_id not in restored]
    for job_id in ids:
        log.warning("job %s failed: a node running its ranks was lost", job_id)
    return ids

