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
from controlplane.emulation.models import EmulationRun
from controlplane.jobs.lifecycle import TransitionKind, TransitionState
from controlplane.jobs.models import Job, MetricSeries, Transition
from controlplane.jobs.plan_preview import plan_preview
from controlplane.jobs.proposals import RANKING_RULE, propose, reconcile
from controlplane.jobs.layouts import STAGING_BYTES, layout_for_resize
from controlplane.jobs.selectors import metric_tail

RECENT_STEPS = 5
EMULATIONS_LOOKED_AT = 200


def recent_step_seconds(job: Job) -> float | None:
    """Median of the job's last RECENT_STEPS step times on its current layout: steps after
    its last committed switch (None before the first one of them)."""
    series = MetricSeries.objects.filter(job=job, transition=None, rank=None, name="step_seconds").first()
    if series is None:
        return None
    steps, values = metric_tail(series_id=series.pk, points=RECENT_STEPS)
    switched = (Transition.objects.filter(job=job, state=TransitionState.COMMITTED, step__isnull=False)
                .order_by("-step").values_list("step", flat=True).first())
    if switched is not None:
        values = [v for x, v in zip(steps, values) if x > switched]
    return statistics.median(values[-RECENT_STEPS:]) if values else None


def finished_emulations(job: Job, capacity: int | None) -> dict[str, dict]:
    """layout -> the newest finished emulation of the job's setting (model, GPU count by
    layout, batch, micro batch, sequence length, no recompute) on any GPU type, as
    proposals show it: {run, gpu_type, step_seconds, tokens_per_second, peak_bytes, fits}."""
    runs = (EmulationRun.objects.filter(kind=EmulationRun.Kind.EMULATE, state=EmulationRun.State.DONE, model=job.model,
                                        global_batch=job.global_batch, micro_batch=job.micro_batch,
                                        seq_len=job.seq_len, recompute="none")
            .order_by("-finished_at", "-id")[:EMULATIONS_LOOKED_AT])
    found: dict[str, dict] = {}
    for run in runs:
        try:
            layout = str(parse_layout(run.layout))
            step, peak = float(run.result["step_seconds"]), int(run.result["memory"]["peak_bytes"])
        except (LayoutError, KeyError, TypeError, ValueError):
            continue
        if layout not in found:
            found[layout] = {"run": run.pk, "gpu_type": run.gpu_type, "step_seconds": step,
                             "tokens_per_second": run.result.get("tokens_per_second"), "peak_bytes": peak,
                             "fits": capacity is None or peak <= capacity}
    return found


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
    emulated = finished_emulations(job, capacity)
    if not ranked:
        raise InvalidInput({"gpus": [
            f"no layout of {job.model} spans {gpus} GPUs with global_batch={job.global_batch} a multiple of "
            f"micro_batch={job.micro_batch} x dp"]})
    return {
        "job": job.pk, "gpus": gpus, "current_layout": job.layout, "current_world": job.world_size,
        "measured_step_seconds": step, "capacity_bytes": capacity, "default_layout": layout_for_resize(job, gpus, model),
        "predictor": "rule", "ranking": RANKING_RULE, "recent_steps": RECENT_STEPS,
        "proposals": [reconcile(p.as_dict(), emulated.get(p.layout)) for p in ranked],
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
