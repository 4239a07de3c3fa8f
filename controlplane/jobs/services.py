"""Writes to jobs: create, delete, and the metric store. Job scheduling and resizing
build on these (the elastic issue)."""
from __future__ import annotations

from collections.abc import Sequence

from django.db import transaction

from agents.layout.errors import LayoutError
from agents.layout.spec import parse_layout
from controlplane.cluster.events import GROUP, STREAM, JobEvent
from controlplane.cluster.selectors import job_view
from controlplane.cluster.services import gpus_release
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.jobs.lifecycle import DELETABLE_JOB_STATES
from controlplane.jobs.metric_codec import CHUNK_POINTS, pack, unpack
from controlplane.jobs.models import Job, MetricChunk, MetricSeries, Transition


def _emit_job(job: Job, op: str) -> None:
    publish_on_commit(GROUP, JobEvent(op=op, seq=next_seq(STREAM), job=job_view(job)))


def job_create(
    *, name: str, model: str, layout: str, global_batch: int = 8, micro_batch: int = 1, seq_len: int = 128,
    created_by=None,
) -> Job:
    """A new pending job. The layout string is validated here (its model-independent
    rules); scheduling it onto GPUs is a separate step."""
    try:
        parsed = parse_layout(layout)
    except LayoutError as exc:
        raise InvalidInput({"layout": [str(exc)]}) from None
    if global_batch % micro_batch:
        raise InvalidInput({"global_batch": [f"global_batch={global_batch} is not a multiple of micro_batch={micro_batch}"]})
    with transaction.atomic():
        if Job.objects.filter(name=name).exists():
            raise InvalidInput({"name": [f"a job named {name!r} already exists"]})
        job = Job.objects.create(
            name=name, model=model, layout=str(parsed), world_size=parsed.world, global_batch=global_batch,
            micro_batch=micro_batch, seq_len=seq_len, created_by=created_by,
        )
        _emit_job(job, "upsert")
    return job


def job_delete(*, job_id: int) -> None:
    """Delete a job that is not running; its GPUs (if any) become free."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.state not in DELETABLE_JOB_STATES:
            raise Conflict(
                f"job {job.name!r} is {job.state}; only jobs that are "
                f"{', '.join(sorted(s.value for s in DELETABLE_JOB_STATES))} can be deleted (stop it first)"
            )
        gpus_release(gpus=job.gpus.all())
        _emit_job(job, "remove")
        job.delete()


def metrics_series_get(*, job: Job, name: str, rank: int | None = None, transition: Transition | None = None,
                       unit: str = "") -> MetricSeries:
    with transaction.atomic():
        series, _ = MetricSeries.objects.select_for_update().get_or_create(
            job=job, transition=transition, name=name, rank=rank, defaults={"unit": unit}
        )
    return series


def metrics_append(*, series_id: int, xs: Sequence[float], ys: Sequence[float]) -> int:
    """Append samples to a series, filling its last chunk before starting a new one.
    Returns the series' point count."""
    if len(xs) != len(ys):
        raise InvalidInput({"samples": [f"{len(xs)} x values but {len(ys)} y values"]})
    with transaction.atomic():
        series = MetricSeries.objects.select_for_update().get(pk=series_id)
        xs, ys = list(xs), list(ys)
        last = series.chunks.order_by("-first_point").first()
        while xs:
            if last is None or last.count >= CHUNK_POINTS:
                last = MetricChunk(series=series, first_point=series.points, count=0, x=b"", y=b"")
            room = CHUNK_POINTS - last.count
            take_x, take_y, xs, ys = xs[:room], ys[:room], xs[room:], ys[room:]
            last.x = pack(unpack(last.x) + take_x)
            last.y = pack(unpack(last.y) + take_y)
            last.count += len(take_x)
            series.points += len(take_x)
            last.save()
        series.save(update_fields=["points"])
    return series.points

