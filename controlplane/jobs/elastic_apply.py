"""The elastic scheduler's decisions, carried out (docs/elastic.md, part 3): read the cluster
and the jobs (elastic_state.py), decide (parallelism/layout/elastic_policy.py), and take each
change through the paths users click: a grow or shrink is resize.job_resize (POST
/api/jobs/{id}/resize) with the decision's reason as the layout history's reason, a start
is scheduling.job_start (POST /api/jobs/{id}/start).

One sweep at a time: a sweep holds the ElasticSweep row's lock for its whole transaction,
and each change takes the locks its path takes (the job's row, then the free GPU rows), so
a sweep and a click never resize one job twice: a job that changed since the sweep read it
(no longer running, switching, another size) is left for the next sweep. Idempotent: a
sweep repeated on the same state decides the same changes, and the first one's resizes
have made those jobs busy (switching) and inside their interval.

Order: shrinks, then grows and starts, highest priority first. A shrink frees its GPUs only
when it commits, so a start or grow that needs them `waits` (no attempt; the commit nudges
the next sweep, elastic_trigger.py). A resize the path refuses (409 or 400: GPUs taken
meanwhile, a layout the planner refuses) counts as a failed resize, like one that aborts
or rolls back (transitions.undo): the scheduler backs off that job.
"""
from __future__ import annotations

import logging
from collections import Counter
from datetime import datetime

from django.conf import settings
from django.db import transaction
from django.db.models import F
from django.utils import timezone

from parallelism.layout.elastic_inputs import Change
from parallelism.layout.errors import LayoutError
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.jobs import resize, scheduling, transitions
from controlplane.jobs.elastic_state import elastic_plan, elastic_state, free_gpus
from controlplane.jobs.elastic_trigger import elastic_work_exists
from controlplane.jobs.lifecycle import JobState
from controlplane.jobs.models import ElasticSweep, Job

log = logging.getLogger(__name__)

ORDER = {"shrink": 0, "grow": 1, "start": 1}


def elastic_sweep(*, why: str = "beat", now: datetime | None = None) -> list[dict]:
    """Decide and carry the changes out (module docstring); returns what became of each:
    {job_id, job, kind, gpus_from, gpus_to, layout, reason, outcome: applied | waits |
    skipped | refused, detail}. Nothing when DYNAPLANE_ELASTIC is off or no job is elastic
    or queued."""
    if not settings.DYNAPLANE_ELASTIC or not elastic_work_exists():
        return []
    ElasticSweep.objects.get_or_create(pk=1)
    with transaction.atomic():
        # One sweep at a time across the worker processes; one that finds another running leaves
        # the decision to it and to the next beat (they would only queue up behind each other).
        sweep = ElasticSweep.objects.select_for_update(skip_locked=True).filter(pk=1).first()
        if sweep is None:
            log.info("elastic (%s): another sweep is running; the next beat looks again", why)
            return []
        now = now or timezone.now()
        state = elastic_state(now, fixed_step_times=False)
        try:
            decision = elastic_plan(state)
        except LayoutError as exc:
            log.error("elastic (%s): no decision: %s", why, exc)
            return []
        changes = sorted(decision.changes, key=lambda c: (ORDER[c.kind], -state.rows[c.job_id].priority, c.job_id))
        outcomes = [apply_change(change, now) for change in changes]
        sweep.ran_at, sweep.outcomes = now, outcomes
        sweep.save(update_fields=["ran_at", "outcomes"])
    for o in outcomes:
        log.info("elastic (%s): job %s %s %s -> %s: %s%s", why, o["job"], o["kind"], o["gpus_from"], o["gpus_to"],
                 o["outcome"], f" ({o['detail']})" if o["detail"] else "")
    return outcomes


def apply_change(change: Change, now: datetime) -> dict:
    """Carry out one change, in a savepoint of the sweep's transaction (a refusal undoes
    only its own writes)."""
    outcome = {"job_id": change.job_id, "job": change.job, "kind": change.kind, "gpus_from": change.gpus_from,
               "gpus_to": change.gpus_to, "layout": change.layout, "reason": change.reason}
    try:
        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=change.job_id)
            moved = changed_since(job, change)
            if moved:
                return {**outcome, "outcome": "skipped", "detail": moved}
            short = missing_gpus(change, free_gpus()) if change.kind in ("grow", "start") else ""
            if short:
                return {**outcome, "outcome": "waits", "detail": f"the GPUs it would take are not free yet "
                                                                 f"({short}); shrinking jobs free theirs at commit"}
            if change.kind == "start":
                start_layout(job, change)
                scheduling.job_start(job_id=job.pk)
                return {**outcome, "outcome": "applied", "detail": ""}
            row = resize.job_resize(job_id=job.pk, layout=change.layout, reason=change.reason)
            return {**outcome, "outcome": "applied", "detail": f"transition {row.pk}"}
    except (Conflict, InvalidInput) as exc:
        if change.kind != "start":
            resize_refused(change.job_id, now)
        log.warning("elastic: job %s %s to %s refused: %s", change.job, change.kind, change.gpus_to, exc)
        return {**outcome, "outcome": "refused", "detail": str(exc)[:500]}


def missing_gpus(change: Change, free: Counter) -> str:
    """What the joining ranks of a grow or start lack on the nodes the decision put them on
    ("" when every one is free now)."""
    need = Counter(change.holding[change.gpus_from:])
    short = {node: n - free.get(node, 0) for node, n in sorted(need.items()) if free.get(node, 0) < n}
    return ", ".join(f"{n} more on {node}" for node, n in short.items())


def changed_since(job: Job, change: Change) -> str:
    """Why the (locked) job is no longer what the decision was made on ("" when it is)."""
    if change.kind == "start":
        if job.state != JobState.PENDING or not job.queued:
            return f"job {job.name!r} is {job.state}{'' if job.queued else ', not queued'}"
        return ""
    if job.state != JobState.RUNNING:
        return f"job {job.name!r} is {job.state}"
    active = transitions.active_transition(job)
    if active is not None:
        return f"job {job.name!r} has transition {active.pk} {active.state}"
    if job.world_size != change.gpus_from:
        return f"job {job.name!r} runs on {job.world_size} GPUs now, not {change.gpus_from}"
    return ""


def start_layout(job: Job, change: Change) -> None:
    """An elastic arrival starts on the size the decision chose, in that size's layout."""
    if change.layout and change.layout != job.layout:
        job.layout, job.world_size = change.layout, change.gpus_to
        job.save(update_fields=["layout", "world_size", "updated_at"])


def resize_refused(job_id: int, now: datetime) -> None:
    """A resize the path refused counts as a failed one (the scheduler backs off)."""
    Job.objects.filter(pk=job_id).update(resize_failures=F("resize_failures") + 1, resize_failed_at=now)
