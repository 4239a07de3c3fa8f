"""Settle what the database believes against what the agents report they run (issue 11):
after a restart of the stack, a job showed `running` with no rank process anywhere, kept
its GPUs, and a stop left it `stopping` for minutes; an emulation run whose agent died
stayed `running` forever.

The agents' heartbeats carry their live rank processes and emulation runs (the observed
state, Node.running_jobs / running_emulations). A beat task compares; a difference is
settled only once every node concerned is healthy and has reported at least GRACE after the
record last changed, so that orders still on their way and processes still starting are
never mistaken for lost ones:
- a `stopping` job none of whose nodes runs a rank of it: stopped, its GPUs free;
- a `starting`, `running` or `switching` job none of whose nodes (the joining ranks' ones
  included) runs a rank of it: its resize aborted with the reason, the job restored from its
  latest checkpoint where it has one (restore.py), else failed with the reason, GPUs free.
  (A resize's own timeout, controlplane/jobs/timeouts.py, waits minutes for reports: after a
  restart of the whole stack none will come, and this settles the job within seconds.)
  (A `restoring` job is left to its restore task.)
(The emulation runs are settled the same way: controlplane/emulation/services.py,
emulations_reconcile.)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from agents.liveness import TAKEN
from controlplane.cluster.lifecycle import NodeState
from controlplane.cluster.liveness import last_heard, later
from controlplane.cluster.models import Node
from controlplane.jobs.failures import job_fail, job_finish
from controlplane.jobs.lifecycle import TERMINAL_TRANSITION_STATES, JobState, JobTrigger, job_next_state
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.preflight import running_start_check
from controlplane.jobs.restore import restore_begin
from controlplane.jobs.timeouts import last_moved
from controlplane.jobs.transitions import active_transition, nodes_of

log = logging.getLogger(__name__)

# A job is settled within the grace + a sweep (5 s) + a heartbeat (2 s) of its last change.
GRACE = timedelta(seconds=settings.DYNAPLANE_RECONCILE_GRACE_SECONDS)


@dataclass(frozen=True, slots=True)
class Seen:
    """One node's observed state: healthy or not, when it last reported, the jobs it runs."""

    healthy: bool
    reported_at: datetime | None
    jobs: frozenset[int]


def unseen(nodes_of_job: list[str], changed_at: datetime, job_id: int, seen: dict[str, Seen],
           grace: timedelta = GRACE) -> bool:
    """Has every node of the job reported, healthy, `grace` after the job's record last
    changed, with no rank of it? (Pure: the rule the sweep applies.)"""
    if not nodes_of_job:
        return False
    for name in nodes_of_job:
        node = seen.get(name)
        if node is None or not node.healthy or node.reported_at is None or node.reported_at < changed_at + grace:
            return False
        if job_id in node.jobs:
            return False
    return True


def observed() -> dict[str, Seen]:
    """Each node as the database holds its last heartbeat: its runs, and when the last heartbeat
    it reflects came (written when one changed the node; taken unchanged since: liveness.py)."""
    nodes = list(Node.objects.only("name", "state", "last_heartbeat", "running_jobs"))
    taken = last_heard([n.name for n in nodes], which=TAKEN)
    return {n.name: Seen(n.state == NodeState.HEALTHY, later(n.last_heartbeat, taken.get(n.name)),
                         frozenset(int(job) for job in (n.running_jobs or {})))
            for n in nodes}


def jobs_reconcile(*, grace: timedelta = GRACE) -> list[tuple[int, str]]:
    """The beat's sweep over live jobs; returns (job id, what it became) for each one settled.
    Two queries for all live jobs (they and their active transitions); a job is locked and read
    again only when it looks unseen."""
    seen = observed()
    jobs = list(Job.objects.filter(state__in=[JobState.STARTING, JobState.RUNNING, JobState.SWITCHING,
                                              JobState.STOPPING]))
    active = {t.job_id: t for t in Transition.objects.filter(job__in=[job.pk for job in jobs]).exclude(
        state__in=[s.value for s in TERMINAL_TRANSITION_STATES])}
    settled = []
    for job in jobs:
        nodes = sorted(nodes_of(job, active.get(job.pk)))
        changed_at = changed_at_of(job, active.get(job.pk))
        if not unseen(nodes, changed_at, job.pk, seen, grace):
            continue
        if running_start_check(job) is not None:  # no rank was ordered yet: its pre-flight's deadline rules
            continue
        with transaction.atomic():
            locked = Job.objects.select_for_update().get(pk=job.pk)
            if locked.state != job.state or changed_at_of(locked, active_transition(locked)) != changed_at:
                continue  # it moved meanwhile: look again next sweep
            where = ", ".join(nodes)
            if locked.state == JobState.STOPPING:
                job_finish(locked, state=job_next_state(JobState.STOPPING, JobTrigger.STOPPED))
                settled.append((job.pk, "stopped"))
                continue
            cause = (f"no rank process of the job runs on its nodes ({where}) any more: their agents report "
                     f"none (the agents or the stack restarted, or the ranks died unreported)")
            if restore_begin(locked, cause=cause, known_lost=True):
                settled.append((job.pk, "restoring"))
            else:
                job_fail(job_id=job.pk, error=f"{cause}; it has no checkpoint to restore from")
                settled.append((job.pk, "failed"))
    for job_id, became in settled:
        log.warning("job %s: settled as %s (its agents report no rank of it)", job_id, became)
    return settled


def changed_at_of(job: Job, active: Transition | None) -> datetime:
    """When the job's record or its active transition (`active`) last changed."""
    return job.updated_at if active is None else max(job.updated_at, last_moved(active))


def reconcile_sweep() -> list[tuple[int, str]]:
    return jobs_reconcile()
