"""What the cluster timeline (elastic_figures.allocation_figure) is drawn from, read from
the rows: each job's first placement (Job.started_at), its committed switches (resizes and
restores, the layout history, with their reasons) and its end (a stopped or failed job's
last update). Jobs live now or ended within `within`, the most recently started first."""
from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django.db.models import Q

from controlplane.jobs.lifecycle import LIVE_JOB_STATES, JobState, TransitionState
from controlplane.jobs.models import Job, Transition

WITHIN = timedelta(days=1)
MOST_JOBS = 20


def _world(world: int | None, placement: list) -> int:
    return world if world is not None else len(placement or [])


def allocation_history(now: datetime, *, within: timedelta = WITHIN, most: int = MOST_JOBS) -> list[dict]:
    """The jobs as allocation_figure takes them."""
    jobs = list(Job.objects.filter(started_at__isnull=False)
                .filter(Q(state__in=[s.value for s in LIVE_JOB_STATES]) | Q(updated_at__gte=now - within))
                .order_by("-started_at", "-id")[:most])
    switches = defaultdict(list)
    for t in (Transition.objects.filter(job__in=jobs, state=TransitionState.COMMITTED)
              .order_by("finished_at", "created_at", "id")):
        switches[t.job_id].append(t)
    out = []
    for job in jobs:
        committed = switches[job.pk]
        first = _world(committed[0].source_world, committed[0].source_placement) if committed else job.world_size
        ended = job.state in (JobState.STOPPED, JobState.FAILED)
        out.append({
            "name": job.name, "start": job.started_at, "gpus": first,
            "changes": [{"at": max(t.finished_at or t.created_at, job.started_at),
                         "gpus_from": _world(t.source_world, t.source_placement),
                         "gpus": _world(t.destination_world, t.destination_placement),
                         "reason": t.reason, "kind": t.kind, "transition": t.pk} for t in committed],
            "end": max(job.updated_at, job.started_at) if ended else None,
        })
    return out
