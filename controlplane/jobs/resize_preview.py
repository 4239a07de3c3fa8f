"""Reads behind the resize flow's preview: ranked proposals for N GPUs and the plan of a
switch, from the job's row, its measured step time and the GPU inventory (the maths is
in proposals.py and plan_preview.py)."""
from __future__ import annotations

import statistics

from django.db.models import Min

from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import place
from parallelism.layout.spec import parse_layout
from controlplane.cluster.models import Gpu
from controlplane.cluster.selectors import gpus_per_node
from controlplane.common import inputs
from controlplane.common.errors import InvalidInput
from controlplane.jobs.lifecycle import TransitionKind
from controlplane.jobs.models import Job, MetricSeries, Transition
from controlplane.jobs.plan_preview import plan_preview
from controlplane.jobs.proposals import RANKING_RULE, propose
from controlplane.jobs.layouts import STAGING_BYTES, layout_for_resize
from controlplane.jobs.selectors import metric_points

RECENT_STEPS = 5


def recent_step_seconds(job: Job) -> float | None:
    """Median of the job's last RECENT_STEPS step times (None before the first step)."""
    series = MetricSeries.objects.filter(job=job, transition=None, rank=None, name="step_seconds").first()
    if series is None:
        return None
    _, values = metric_points(series_id=series.pk)
    return statistics.median(values[-RECENT_STEPS:]) if values else None


def gpu_capacity_bytes() -> int | None:
    """The smallest GPU memory in the inventory (a layout must fit on every GPU it may get)."""
    return Gpu.objects.aggregate(smallest=Min("memory_bytes"))["smallest"] or None


def job_proposals(*, job: Job, gpus: int) -> dict:
    """GET /api/jobs/{id}/proposals?gpus=N."""
    step = recent_step_seconds(job)
    capacity = gpu_capacity_bytes()
    model = inputs.model_of(job.model)
    try:
        ranked = propose(model, current_layout=job.layout, gpus=gpus, global_batch=job.global_batch,
                         micro_batch=job.micro_batch, seq_len=job.seq_len, capacity_bytes=capacity, step_seconds=step)
    except LayoutError as exc:
        raise InvalidInput({"gpus": [str(exc)]}) from None
    if not ranked:
        raise InvalidInput({"gpus": [
            f"no layout of {job.model} spans {gpus} GPUs with global_batch={job.global_batch} a multiple of "
            f"micro_batch={job.micro_batch} x dp"]})
    return {
        "job": job.pk, "gpus": gpus, "current_layout": job.layout, "current_world": job.world_size,
        "measured_step_seconds": step, "capacity_bytes": capacity, "default_layout": layout_for_resize(job, gpus, model),
        "predictor": "rule", "ranking": RANKING_RULE, "proposals": [p.as_dict() for p in ranked],
    }


def job_plan(*, job: Job, layout: str) -> dict:
    """GET /api/jobs/{id}/plan?layout=L: the switch from the job's layout to L."""
    try:
        text = str(parse_layout(layout))
        model = inputs.model_of(job.model)
        inputs.plan_world_check(place(model, job.layout), place(model, text))
        return plan_preview(model, job.layout, text, gpus_per_node=gpus_per_node(),
                            staging_bytes=STAGING_BYTES)
    except LayoutError as exc:
        raise InvalidInput({"layout": [f"the switch {job.layout} -> {layout} cannot be planned: {exc}"]}) from None


def transition_plan(*, transition: Transition) -> dict:
    """The plan a transition ran, recomputed from what it recorded (same inputs, same plan).
    A restore loaded a checkpoint and ran no plan: InvalidInput says so."""
    if transition.kind == TransitionKind.RESTORE:
        raise InvalidInput({"transition": [f"transition {transition.pk} is a restore from a checkpoint: "
                                           "no routing plan ran"]})
    return plan_preview(inputs.model_of(transition.job.model), transition.source_layout, transition.destination_layout,
                        gpus_per_node=transition.gpus_per_node or 1,
                        staging_bytes=transition.staging_bytes or STAGING_BYTES,
                        map_ranks=False, process_of=transition.process_of or None)
