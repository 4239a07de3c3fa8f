"""Reads of jobs and metrics."""
from __future__ import annotations

from django.db import transaction

from controlplane.common.models import EventStream
from controlplane.jobs.events import (
    METRIC_NAMES,
    JobLiveSnapshot,
    JobLogView,
    RankSlotView,
    Series,
    TransferProgressView,
    TransitionView,
    job_stream,
)
from controlplane.jobs.metric_codec import unpack
from controlplane.jobs.models import JobLog, MetricChunk, MetricSeries, Transition


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def transition_view(t: Transition) -> TransitionView:
    return TransitionView(
        id=t.pk, job=t.job_id, source_layout=t.source_layout, destination_layout=t.destination_layout,
        source_world=t.source_world, destination_world=t.destination_world, state=t.state, reason=t.reason,
        plan_fingerprint=t.plan_fingerprint,
        destination_placement=tuple(RankSlotView(**slot) for slot in t.destination_placement),
        rendezvous=t.rendezvous, created_at=_iso(t.created_at), started_at=_iso(t.started_at),
        finished_at=_iso(t.finished_at), step=t.step, prepare_seconds=t.prepare_seconds,
        pause_seconds=t.pause_seconds, transfer_seconds=t.transfer_seconds, verify_seconds=t.verify_seconds,
        network_bytes=t.network_bytes, rounds=t.rounds, peak_bytes=t.peak_bytes,
        predicted_peak_bytes=t.predicted_peak_bytes, verified=(t.verification or {}).get("verified"), kind=t.kind,
        progress=TransferProgressView(**t.progress) if t.progress else None)


def metric_points(*, series_id: int) -> tuple[list[float], list[float]]:
    """All samples of a series, in append order."""
    xs: list[float] = []
    ys: list[float] = []
    for chunk in MetricSeries.objects.get(pk=series_id).chunks.order_by("first_point"):
        xs += unpack(chunk.x)
        ys += unpack(chunk.y)
    return xs, ys


def metric_tail(*, series_id: int, points: int) -> tuple[list[float], list[float]]:
    """The series' last `points` samples or more (whole chunks, newest last), in append order:
    what a sweep needs of a job's step times without reading its whole history."""
    xs: list[list[float]] = []
    ys: list[list[float]] = []
    got = 0
    for chunk in MetricChunk.objects.filter(series_id=series_id).order_by("-first_point"):
        xs.append(unpack(chunk.x))
        ys.append(unpack(chunk.y))
        got += chunk.count
        if got >= points:
            break
    return [x for part in reversed(xs) for x in part], [y for part in reversed(ys) for y in part]


def job_live_snapshot(*, job_id: int) -> JobLiveSnapshot:
    """A job's training metrics and transitions, exactly as of `seq` of the job's stream. Metrics events
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
        transitions = tuple(transition_view(t) for t in Transition.objects.filter(job_id=job_id).order_by("id"))
    return JobLiveSnapshot(seq=seq, metrics=metrics, transitions=transitions)


def job_log_view(*, job_id: int, lines: int | None = None) -> JobLogView:
    """Rank 0's recent log lines of a job (none yet: no lines), the last `lines` of them."""
    row = JobLog.objects.filter(job_id=job_id).first()
    if row is None:
        return JobLogView(job=job_id, node=None, rank=0, lines=(), truncated=False, finished=False, sent_at=None)
    kept = row.lines[-lines:] if lines is not None else row.lines
    return JobLogView(job=job_id, node=row.node, rank=row.rank, lines=tuple(kept),
                      truncated=row.truncated or len(kept) < len(row.lines), finished=row.finished,
                      sent_at=_iso(row.sent_at))


def data_progress(*, step: int | None, global_batch: int, seq_len: int, samples_per_epoch: int | None) -> dict:
    """How far a job has read its data after `step` steps (the trainer's one data scalar is the
    samples consumed, step x global batch, in every layout): samples, tokens (samples x seq) and,
    on a dataset, epochs (samples / samples per epoch at the job's seq). frontend job-store.js's
    dataProgress is its twin for the live page."""
    samples = (step or 0) * global_batch
    epoch = samples / samples_per_epoch if samples_per_epoch else None
    return {"samples": samples, "tokens": samples * seq_len, "epoch": epoch, "samples_per_epoch": samples_per_epoch}


def job_data_progress(job) -> dict:
    return data_progress(step=job.step, global_batch=job.global_batch, seq_len=job.seq_len,
                         samples_per_epoch=job.dataset_samples_per_epoch)
