"""What a lost node means for the jobs on it: a resize whose only lost ranks were joining
is aborted and the job trains on; any other live job with ranks there recovers
(restore.py) or fails. The heartbeat sweep composes the inventory's loss
(cluster.services.nodes_mark_lost) and this, in one transaction, so the cluster app
never calls into the jobs app.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from agents import protocol
from controlplane.cluster.models import Gpu
from controlplane.cluster.services import nodes_mark_lost
from controlplane.jobs import transitions
from controlplane.jobs.elastic_trigger import elastic_nudge
from controlplane.jobs.failures import job_fail
from controlplane.jobs.lifecycle import LIVE_JOB_STATES, TransitionKind, TransitionState
from controlplane.jobs.models import Job
from controlplane.jobs.orders import send_cancels_on_commit
from controlplane.jobs.preflight import start_cancel
from controlplane.jobs.restore import no_restore_reason, restore_begin

log = logging.getLogger(__name__)


def nodes_lost_sweep(*, silent_for: timedelta, now: datetime | None = None,
                     heard_since: datetime | None = None) -> list[str]:
    """The beat's sweep: mark nodes silent for `silent_for` lost (with their GPUs) and act on
    the live jobs with ranks there, all in one transaction. Returns the newly lost nodes.
    `heard_since`: since when the control plane has heard without a break (cluster/shared_hearing.py);
    until it has heard for `silent_for`, no silence counts and no node is lost."""
    now = now or timezone.now()
    if heard_since is not None and now - heard_since < silent_for:
        return []
    with transaction.atomic():
        lost = nodes_mark_lost(silent_for=silent_for, now=now)
        if lost:
            jobs_on_node_loss(nodes=lost)
            elastic_nudge(f"node {', '.join(lost)} lost")
    return lost


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
    joining = sorted(s["rank"] for s in transitions.joining_slots(active) if s["node"] in lost)
    why = (f"node {', '.join(sorted(lost))} (joining ranks {', '.join(map(str, joining))}) lost before the "
           f"transfer; the job trains on in {job.layout}")
    transitions.abort(job, active, why)
    log.warning("job %s: transition %s aborted: %s", job.name, active.pk, why)
    send_cancels_on_commit(job, sorted({slot["node"] for slot in job.placement}),
                           protocol.JobSwitchCancel(job_id=job.pk, transition_id=active.pk, reason=why))
    return True


def jobs_on_node_loss(*, nodes: list[str]) -> list[int]:
    """Called where nodes are marked lost, in that transaction (nodes_lost_sweep): every live job with ranks on
    them restarts from its latest checkpoint on the GPUs it has left (restore.py), or,
    without one, fails. Returns the ids of the jobs that failed."""
    lost = set(nodes)
    ids = sorted(set(Gpu.objects.filter(node__name__in=lost, job__state__in=LIVE_JOB_STATES)
                     .values_list("job_id", flat=True)))
    spared = [job_id for job_id in ids if _abort_switch_of_lost_joiners(job_id, lost)]
    ids = [job_id for job_id in ids if job_id not in spared]
    restored: list[int] = []
    unstarted: list[int] = []
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
        if start_cancel(locked, f"{where} lost during the pre-flight; the job was not started"):
            unstarted.append(job_id)  # back to pending: no rank was ordered to start
            continue
        if restore_begin(locked, cause=f"{where} lost", known_lost=True, lost_nodes=lost, went_silent=True):
            restored.append(job_id)
            continue
        why = no_restore_reason(locked) or f"the job was {locked.state}"
        job_fail(job_id=job_id, error=f"{where} lost: its heartbeats stopped while it ran this job's ranks; {why}")
    ids = [job_id for job_id in ids if job_id not in restored and job_id not in unstarted]
    for job_id in ids:
        log.warning("job %s failed: a node running its ranks was lost", job_id)
    return ids

