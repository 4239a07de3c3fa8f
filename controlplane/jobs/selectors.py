"""Reads of jobs and metrics."""
from __future__ import annotations

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
