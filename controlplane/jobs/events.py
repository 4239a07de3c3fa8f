"""Closed event schemas of one job's stream (/ws/jobs/<id>/): its training metrics, and
the pure snapshot arithmetic apply_job_event(snapshot, event) -> snapshot.

Each job has its own stream (`job.<id>`), so a page that follows one job is not sent every
step of every other job, and its seq counts only that job's events: a page that sees
seq != last + 1 has missed one and reloads GET /api/jobs/<id>/live. The job's state
travels on the cluster stream (JobEvent), as before.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from controlplane.common.events import Closed, HelloEvent

METRIC_NAMES = ("loss", "step_seconds", "tokens_per_second")
METRIC_UNITS = {"loss": "", "step_seconds": "s", "tokens_per_second": "tokens/s"}


def job_stream(job_id: int) -> str:
    """Stream name and channel-layer group of one job (group names allow '.')."""
    return f"job.{job_id}"


class MetricsEvent(Closed):
    """One reported training step: the values appended to the job's metric series."""

    type: Literal["metrics"] = "metrics"
    op: Literal["append"] = "append"
    seq: int
    job: int
    step: int
    loss: float | None
    step_seconds: float | None
    tokens_per_second: float | None


JobStreamEvent = Annotated[Union[MetricsEvent, HelloEvent], Field(discriminator="type")]
job_event_adapter: TypeAdapter = TypeAdapter(JobStreamEvent)


class Series(Closed):
    x: tuple[float, ...]
    y: tuple[float, ...]


class JobLiveSnapshot(Closed):
    """A job's training metrics (name -> points), consistent with `seq` of its stream."""

    seq: int
    metrics: dict[str, Series]


def apply_job_event(snapshot: JobLiveSnapshot, event: MetricsEvent | HelloEvent) -> JobLiveSnapshot:
    """The snapshot after one event; events at or below its seq are already in it."""
    if isinstance(event, HelloEvent) or event.seq <= snapshot.seq:
        return snapshot
    metrics = dict(snapshot.metrics)
    for name in METRIC_NAMES:
        value = getattr(event, name)
        if value is not None:
            old = metrics.get(name, Series(x=(), y=()))
            metrics[name] = Series(x=old.x + (float(event.step),), y=old.y + (value,))
    return JobLiveSnapshot(seq=event.seq, metrics=metrics)
