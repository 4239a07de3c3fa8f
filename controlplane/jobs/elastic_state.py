"""The elastic scheduler's inputs, read from the database (parallelism/layout/elastic_inputs.py),
and its plan: what decide() answers for them (GET /api/elastic shows it; elastic_apply.py
carries it out).

What the scheduler sees:
- nodes: the healthy ones, each with its GPUs that are not lost, and when it joined;
- jobs: every live job that holds GPUs on healthy nodes, and every pending job queued for
  the scheduler (POST /api/jobs queue=true: an arrival). A running job without an active
  transition, whose placement is exactly the GPUs it holds, may be resized (when elastic);
  any other live job is busy: it keeps what it holds (a switching job holds its joining
  GPUs too, a stopping one its GPUs until its ranks leave);
- per job: the range (world_size for a bound not set; a rigid job's is its size), the
  priority, the size options (elastic_options: the resize proposals' best layout per GPU
  count; a rigid arrival has its own layout), the measured step time (the median of its
  last steps), the steps left, the last start or resize (the later of started_at and its
  newest transition), and its failed resizes in a row;
- jobs that ended in the last day (only the reasons name them);
- the settings (DYNAPLANE_ELASTIC_*), the online pause model, and now.
"""
from __future__ import annotations

import logging
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from django.conf import settings as django_settings
from django.db.models import Count, Max, Q
from django.utils import timezone as django_timezone

from parallelism.layout.elastic_inputs import Decision, ElasticJob, ElasticSettings, EndedJob, Node, OnlinePause, SizeOption
from parallelism.layout.elastic_policy import decide
from parallelism.layout.elastic_sizes import backoff_until, frozen_reason
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import tp_block
from controlplane.cluster.lifecycle import GpuState, NodeState
from controlplane.cluster.models import Gpu
from controlplane.cluster.models import Node as NodeRow
from controlplane.cluster.selectors import gpus_per_node
from controlplane.common import inputs
from controlplane.common.errors import InvalidInput
from controlplane.jobs.elastic_options import candidate_sizes, size_options
from controlplane.jobs.lifecycle import LIVE_JOB_STATES, TERMINAL_TRANSITION_STATES, JobState
from controlplane.jobs.models import ElasticSweep, Job, Transition
from controlplane.jobs.resize_preview import gpu_capacity_bytes, recent_step_seconds

log = logging.getLogger(__name__)

ENDED_WITHIN = timedelta(days=1)


@dataclass(frozen=True)
class ElasticState:
    nodes: tuple[Node, ...]
    jobs: tuple[ElasticJob, ...]
    ended: tuple[EndedJob, ...]
    settings: ElasticSettings
    now: float
    rows: dict[int, Job]  # the job rows read, by id


def elastic_settings() -> ElasticSettings:
    s = django_settings
    return ElasticSettings(min_interval_seconds=s.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS,
                           backoff_seconds=s.DYNAPLANE_ELASTIC_BACKOFF_SECONDS,
                           backoff_max_seconds=s.DYNAPLANE_ELASTIC_BACKOFF_MAX_SECONDS,
                           grow_horizon_seconds=s.DYNAPLANE_ELASTIC_GROW_HORIZON_SECONDS, pause=OnlinePause())


def _seconds(at: datetime | None) -> float | None:
    return at.timestamp() if at is not None else None


def free_gpus() -> Counter:
    """Free GPUs per healthy node, now."""
    return Counter(Gpu.objects.filter(state=GpuState.FREE, job__isnull=True, node__state=NodeState.HEALTHY)
                   .values_list("node__name", flat=True))


def _own_option(model, job: Job) -> SizeOption:
    return SizeOption(gpus=job.world_size, layout=job.layout, block=tp_block(inputs.placement_of(model, job.layout)))


def _options(job: Job, lo: int, hi: int, current: int, per_node: int, capacity: int | None,
             step: float | None) -> tuple[SizeOption, ...]:
    """The sizes an elastic job (or any arrival) may take; () when its model cannot be read."""
    try:
        model = inputs.model_of(job.model)
        if not job.elastic:
            return (_own_option(model, job),)
        sizes = sorted(set(candidate_sizes(lo, hi, per_node)) | ({current} if current else set()))
        options = size_options(model, layout=job.layout, sizes=sizes, global_batch=job.global_batch,
                               micro_batch=job.micro_batch, seq_len=job.seq_len, step_seconds=step,
                               capacity_bytes=capacity)
        if not current and all(o.gpus != job.world_size for o in options) and lo <= job.world_size <= hi:
            # (e.g. a layout the proposals do not cover)
            options = (*options, _own_option(model, job))
        return tuple(sorted(options, key=lambda o: o.gpus))
    except (InvalidInput, LayoutError) as exc:
        log.warning("elastic: job %s has no size options: %s", job.name, exc)
        return ()


def _holding(job: Job, held: list[tuple[str, int]], active: bool) -> tuple[tuple[str, ...], bool]:
    """(the node of each GPU the job holds, in rank order when it may be resized; busy)."""
    slots = sorted(job.placement or [], key=lambda s: s["rank"])
    if job.state == JobState.RUNNING and not active and {(s["node"], s["gpu"]) for s in slots} == set(held) \
            and len(slots) == len(held):
        return tuple(s["node"] for s in slots), False
    return tuple(sorted(node for node, _ in held)), True


def elastic_state(now: datetime | None = None, *, fixed_step_times: bool = True) -> ElasticState:
    """Everything decide() takes, read from the database now (see the module docstring).
    `fixed_step_times` False: the step times of jobs that are not elastic are left out (the
    decision never resizes them; the sweep saves a series read per job; the overview shows them)."""
    now = now or django_timezone.now()
    counts = dict(Gpu.objects.filter(node__state=NodeState.HEALTHY).exclude(state=GpuState.LOST).order_by()
                  .values("node__name").annotate(n=Count("id")).values_list("node__name", "n"))  # (a row a node)
    nodes = tuple(Node(name=n.name, gpus=counts.get(n.name, 0), joined_at=_seconds(n.joined_at or n.registered_at))
                  for n in NodeRow.objects.filter(state=NodeState.HEALTHY).order_by("name"))
    held: dict[int, list[tuple[str, int]]] = defaultdict(list)
    for job_id, node, index in (Gpu.objects.filter(node__state=NodeState.HEALTHY, job__isnull=False)
                                .exclude(state=GpuState.LOST).values_list("job_id", "node__name", "index")):
        held[job_id].append((node, index))
    rows = {job.pk: job for job in Job.objects.filter(
        Q(state__in=[s.value for s in LIVE_JOB_STATES]) | Q(state=JobState.PENDING, queued=True)).order_by("id")}
    transitions = Transition.objects.filter(job_id__in=list(rows))
    active = set(transitions.exclude(state__in=[s.value for s in TERMINAL_TRANSITION_STATES])
                 .values_list("job_id", flat=True))
    last_change = dict(transitions.values("job_id").annotate(at=Max("created_at")).values_list("job_id", "at"))
    per_node, capacity = gpus_per_node(), gpu_capacity_bytes()
    jobs = []
    for job in rows.values():
        pending = job.state == JobState.PENDING
        holding, busy = ((), False) if pending else _holding(job, held.get(job.pk, []), job.pk in active)
        if not pending and not holding:
            continue  # it holds no GPU the scheduler could count (e.g. restoring after every node was lost)
        current = len(holding)
        size = job.world_size if pending else current
        lo, hi = job.gpu_range if job.elastic else (size, size)
        hi = max(lo, hi)  # (a bound left unset follows world_size, which a click may have put below min_gpus)
        step = None if pending or not (job.elastic or fixed_step_times) else recent_step_seconds(job)
        top = min(hi, sum(counts.values()))  # (no option larger than the cluster: a range may be far wider)
        options = _options(job, lo, top, current, per_node, capacity, step) if (job.elastic or pending) else ()
        changes = [at for at in (job.started_at, last_change.get(job.pk)) if at is not None]
        try:
            jobs.append(ElasticJob(
                id=job.pk, name=job.name, gpus=size, priority=job.priority, elastic=job.elastic, min_gpus=lo,
                max_gpus=hi, holding=holding, options=options, busy=busy, step_seconds=step,
                remaining_steps=max(job.max_steps - (job.step or 0), 0) if job.max_steps else None,
                last_resize_at=_seconds(max(changes)) if changes else None, failed_resizes=job.resize_failures,
                last_failure_at=_seconds(job.resize_failed_at)))
        except LayoutError as exc:  # (the range rules rule this out; a job left out is never resized or started)
            log.error("elastic: job %s left out: %s", job.name, exc)
    ended = tuple(EndedJob(name=name, priority=priority, ended_at=at.timestamp()) for name, priority, at in
                  Job.objects.filter(state__in=[JobState.STOPPED, JobState.FAILED], started_at__isnull=False,
                                     updated_at__gte=now - ENDED_WITHIN)
                  .order_by("-updated_at").values_list("name", "priority", "updated_at")[:20])
    return ElasticState(nodes=nodes, jobs=tuple(jobs), ended=ended, settings=elastic_settings(),
                        now=now.timestamp(), rows=rows)


def elastic_plan(state: ElasticState) -> Decision:
    """What the scheduler decides for this state. LayoutError when the state is inconsistent
    (e.g. a node holding more GPUs than it has), which the reads above rule out."""
    return decide(state.nodes, state.jobs, state.settings, state.now, state.ended)


def _at(seconds: float | None) -> str | None:
    return datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat() if seconds is not None else None


def elastic_overview(now: datetime | None = None) -> dict:
    """GET /api/elastic: what the scheduler sees and decides now, and what its last sweep
    did (a read: nothing is applied)."""
    state = elastic_state(now)
    try:
        decision, problem = elastic_plan(state), None
    except LayoutError as exc:
        decision, problem = Decision(changes=(), waiting=()), f"the scheduler cannot decide on this state: {exc}"
    free = free_gpus()
    s = state.settings
    jobs = []
    for job in state.jobs:
        row = state.rows[job.id]
        until = backoff_until(job, s)
        jobs.append({
            "id": job.id, "name": job.name, "state": row.state, "elastic": job.elastic,
            "min_gpus": job.min_gpus, "max_gpus": job.max_gpus, "priority": job.priority, "gpus": job.current,
            "queued": row.queued and row.state == JobState.PENDING, "busy": job.busy,
            "frozen": frozen_reason(job, s, state.now) if job.running else None,
            "step_seconds": job.step_seconds, "remaining_steps": job.remaining_steps,
            "last_resize_at": _at(job.last_resize_at), "resize_failures": job.failed_resizes,
            "backoff_until": _at(until) if until is not None and until > state.now else None,
            "options": [{"gpus": o.gpus, "layout": o.layout, "step_seconds": o.step_seconds} for o in job.options],
        })
    sweep = ElasticSweep.objects.filter(pk=1).first()
    return {
        "enabled": django_settings.DYNAPLANE_ELASTIC, "problem": problem,
        "settings": {"min_interval_seconds": s.min_interval_seconds, "backoff_seconds": s.backoff_seconds,
                     "backoff_max_seconds": s.backoff_max_seconds, "grow_horizon_seconds": s.grow_horizon_seconds,
                     "sweep_seconds": django_settings.CELERY_BEAT_SCHEDULE["sweep-elastic"]["schedule"],
                     "debounce_seconds": django_settings.DYNAPLANE_ELASTIC_DEBOUNCE_SECONDS},
        "gpus": sum(n.gpus for n in state.nodes), "free": sum(free.values()),
        "nodes": [{"name": n.name, "gpus": n.gpus, "free": free.get(n.name, 0), "joined_at": _at(n.joined_at)}
                  for n in state.nodes],
        "jobs": jobs,
        "decisions": [{"job_id": c.job_id, "job": c.job, "kind": c.kind, "gpus_from": c.gpus_from,
                       "gpus_to": c.gpus_to, "layout": c.layout, "reason": c.reason,
                       "step_seconds": c.step_seconds, "pause_seconds": c.pause_seconds,
                       "gain_seconds": c.gain_seconds} for c in decision.changes],
        "waiting": [{"job_id": job_id, "job": state.rows[job_id].name, "reason": why}
                    for job_id, why in decision.waiting],
        "last_sweep": {"ran_at": sweep.ran_at, "outcomes": sweep.outcomes} if sweep and sweep.ran_at else None,
    }
