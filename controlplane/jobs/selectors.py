"""Reads of jobs and metrics."""
from __future__ import annotations

from django.db import transaction

from controlplane.common.models import EventStream
from controlplane.jobs.events import METRIC_NAMES, JobLiveSnapshot, Series, job_stream
from controlplane.jobs.metric_codec import unpack
from controlplane.jobs.models import MetricSeries


def metric_points(*, series_id: int) -> tuple[list[float], list[float]]:
    """All samples of a series, in append order."""
    xs: list[float] = []
    ys: list[float] = []
    for chunk in MetricSeries.objects.get(pk=series_id).chunks.order_by("first_point"):
        xs += unpack(chunk.x)
        ys += unpack(chunk.y)
    return xs, ys


def job_live_snapshot(*, job_id: int) -> JobLiveSnapshot:
    """A job's training metrics, exactly as of `seq` of the job's stream. Metrics events
    append, so applying one twice would duplicate a point: the stream's counter row is
    locked while reading, which holds back writers (they bump it in their transaction)."""
    with transaction.atomic():
        stream = job_stream(job_id)
        EventStream.objects.get_or_create(name=stream)
        seq = EventStream.objects.select_for_update().values_list("seq", flat=True).get(name=stream)
        metrics = {}
        for series in MetricSeries.objects.filter(job_id=job_id, transition=None, rank=None, name__in=METRIC_NAMES):
            xs, ys = metric_points(series_id=series.pk)
            metrics[series.name] = Series(x=tuple(xs), y=tuple(ys))
    return JobLiveSnapshot(seq=seq, metrics=metrics)
