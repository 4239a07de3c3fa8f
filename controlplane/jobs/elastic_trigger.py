"""When the elastic scheduler looks again: a `control.sweep_elastic` task queued after a
change that may alter its answer, on top of its beat (docs/elastic.md, part 3).

Every change of a job's state reaches services.publish_job (created, started, running,
switching and back, stopped, failed, restoring, its elastic settings changed), which calls
elastic_nudge; a node that joined is noticed by nudge_for_joined_nodes (the lost-node
sweep's beat calls it every second), a lost one through its jobs, or by nodes_lost_sweep.

Cheap when there is nothing to do: no task is queued unless some live job is elastic or
some pending job is queued for the scheduler (one indexed query). Debounced: the task
runs DYNAPLANE_ELASTIC_DEBOUNCE_SECONDS after the commit, and while a task this process
queued is not due yet, later changes queue none (that task starts after them and sees
them). A sweep that finds nothing to change changes nothing, so a spare one is harmless.
"""
from __future__ import annotations

import logging
import threading
import time

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from kombu.exceptions import OperationalError

from agents import protocol
from controlplane.celery import app
from controlplane.cluster.lifecycle import NodeState
from controlplane.cluster.models import Node
from controlplane.jobs.lifecycle import LIVE_JOB_STATES, JobState
from controlplane.jobs.models import ElasticSweep, Job

log = logging.getLogger(__name__)

_lock = threading.Lock()
_due = 0.0  # (monotonic) when the sweep this process queued last starts, at the earliest


def elastic_work_exists() -> bool:
    """Whether the scheduler may act on anything: a live elastic job or a queued pending one."""
    return Job.objects.filter(Q(elastic=True, state__in=[s.value for s in LIVE_JOB_STATES])
                              | Q(queued=True, state=JobState.PENDING)).exists()


def elastic_nudge(why: str) -> None:
    """After the current transaction commits, queue a sweep (unless one is queued already
    and not due yet, or there is nothing the scheduler acts on)."""
    if settings.DYNAPLANE_ELASTIC and elastic_work_exists():
        transaction.on_commit(lambda: _queue(why))


def _queue(why: str) -> None:
    global _due
    delay = settings.DYNAPLANE_ELASTIC_DEBOUNCE_SECONDS
    now = time.monotonic()
    with _lock:
        if now < _due:
            return  # the queued sweep starts after this change: it will see it
        _due = now + delay
    try:
        app.send_task(protocol.CONTROL_SWEEP_ELASTIC, args=[why[:200]], queue=protocol.CONTROL_FLOWS_QUEUE,
                      countdown=delay)
    except (OperationalError, OSError) as exc:  # the beat's next sweep comes anyway
        with _lock:
            _due = 0.0
        log.warning("elastic sweep not queued (%s): %s", why, exc)


def forget_queued() -> None:
    """Forget the sweep this process queued: the next nudge queues one at once (tests)."""
    global _due
    with _lock:
        _due = 0.0


def nudge_for_joined_nodes() -> list[str]:
    """Nudge when a node joined (registered, or came back) after the last sweep read the
    cluster; returns their names."""
    if not settings.DYNAPLANE_ELASTIC:
        return []
    last = ElasticSweep.objects.filter(pk=1).values_list("ran_at", flat=True).first()
    joined = Node.objects.filter(state=NodeState.HEALTHY, joined_at__isnull=False)
    if last is not None:
        joined = joined.filter(joined_at__gt=last)
    names = sorted(joined.values_list("name", flat=True))
    if names:
        elastic_nudge(f"node {', '.join(names)} joined")
    return names
