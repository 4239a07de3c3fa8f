"""Closed event schemas of one job's stream (/ws/jobs/<id>/): its training metrics and its
layout transitions (resizes), and the pure snapshot arithmetic
apply_job_event(snapshot, event) -> snapshot.

Each job has its own stream (`job.<id>`), so a page that follows one job is not sent every
step of every other job, and its seq counts only that job's events: a page that sees
seq != last + 1 has missed one and reloads GET /api/jobs/<id>/live. The job's state
travels on the cluster stream (JobEvent), as before.
"""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from controlplane.common.events import Closed, HelloEvent

# A step report's metrics, each a series of the job (x: the step); validation_loss only at the
# job's eval_every steps (rank 0 reports it with that step, JobStepped.validation_loss).
METRIC_NAMES = ("loss", "step_seconds", "tokens_per_second", "validation_loss")
METRIC_UNITS = {"loss": "", "step_seconds": "s", "tokens_per_second": "tokens/s", "validation_loss": ""}


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
    validation_loss: float | None = None  # at the job's eval_every steps


class CheckpointEvent(Closed):
    """A periodic checkpoint of the job is complete (the latest one is what a restore loads)."""

    type: Literal["checkpoint"] = "checkpoint"
    op: Literal["upsert"] = "upsert"
    seq: int
    job: int
    step: int
    path: str
    seconds: float | None


class RewindEvent(Closed):
    """The job restarted from its checkpoint at `step`: the steps recorded after it were not the
    trajectory the weights took (the restore discarded them) and are gone from every series;
    the ranks train them again and their reports append as usual (issue 43)."""

    type: Literal["rewind"] = "rewind"
    op: Literal["truncate"] = "truncate"
    seq: int
    job: int
    step: int


class RankSlotView(Closed):
    rank: int
    node: str
    gpu: int


class TransferProgressView(Closed):
    """A switch's state transfer: rounds done of `rounds`, the plan's network bytes of those
    rounds, measured state bytes per rank ("rank" -> the start, then per round its peak
    and the bytes after it; rank 0 while it runs, every rank once committed)."""

    round: int
    rounds: int
    moved_bytes: int
    waves: dict[str, tuple[int, ...]]


class TransitionView(Closed):
    """One transition (layout switch) of the job, as the job's page shows it."""

    id: int
    job: int
    source_layout: str
    destination_layout: str
    source_world: int | None
    destination_world: int | None
    state: str
    reason: str
    plan_fingerprint: str
    destination_placement: tuple[RankSlotView, ...]
    rendezvous: str
    created_at: str
    started_at: str | None
    finished_at: str | None
    step: int | None
    prepare_seconds: float | None
    pause_seconds: float | None
    transfer_seconds: float | None
    verify_seconds: float | None
    network_bytes: int | None
    rounds: int | None
    peak_bytes: int | None
    predicted_peak_bytes: int | None
    verified: bool | None
    kind: str = "resize"  # or "restore": a restart from a checkpoint after ranks were lost
    progress: TransferProgressView | None = None


class TransitionEvent(Closed):
    """A transition was created or changed state (whole object: applying it twice is harmless)."""

    type: Literal["transition"] = "transition"
    op: Literal["upsert"] = "upsert"
    seq: int
    transition: TransitionView


class JobLogView(Closed):
    """Rank 0's recent log lines (GET /api/jobs/{id}/log; the `log` event's payload)."""

    job: int
    node: str | None
    rank: int
    lines: tuple[str, ...]
    truncated: bool
    finished: bool
    sent_at: str | None


class LogEvent(Closed):
    """Rank 0's log tail changed: the whole tail (bounded; it replaces the page's). Like a
    checkpoint it lives in its own row, not in the live snapshot, which only moves on."""

    type: Literal["log"] = "log"
    op: Literal["replace"] = "replace"
    seq: int
    log: JobLogView


class ExportView(Closed):
    """One export of a job's checkpoint as a Hugging Face directory (GET /api/exports/{id}; the
    `export` event's payload): its state, progress (weight files written of the total) and
    result (the directory relative to the exports root, its bytes and seconds, or the error)."""

    id: int
    job: int | None  # null once the job is deleted (the directory stays)
    job_name: str
    checkpoint_step: int
    state: Literal["pending", "running", "done", "failed"]
    path: str
    files_written: int
    files_total: int | None
    bytes: int
    seconds: float | None
    error: str
    created_at: str
    started_at: str | None
    finished_at: str | None


class ExportEvent(Closed):
    """An export of the job was requested or moved on (whole object: applying it twice is
    harmless). Like a checkpoint it lives in its own row; the live snapshot only moves on."""

    type: Literal["export"] = "export"
    op: Literal["upsert"] = "upsert"
    seq: int
    export: ExportView


JobStreamEvent = Annotated[Union[MetricsEvent, TransitionEvent, CheckpointEvent, LogEvent, ExportEvent, RewindEvent,
                                 HelloEvent], Field(discriminator="type")]
job_event_adapter: TypeAdapter = TypeAdapter(JobStreamEvent)


class Series(Closed):
    x: tuple[float, ...]
    y: tuple[float, ...]


class JobLiveSnapshot(Closed):
    """A job's training metrics (name -> points) and its transitions (oldest first),
    consistent with `seq` of its stream."""

    seq: int
    metrics: dict[str, Series]
    transitions: tuple[TransitionView, ...] = ()


def apply_job_event(snapshot: JobLiveSnapshot, event: MetricsEvent | TransitionEvent | CheckpointEvent | LogEvent
                    | ExportEvent | RewindEvent | HelloEvent) -> JobLiveSnapshot:
    """The snapshot after one event; events at or below its seq are already in it."""
    if isinstance(event, HelloEvent) or event.seq <= snapshot.seq:
        return snapshot
    if isinstance(event, TransitionEvent):
        new = event.transition
        others = [t for t in snapshot.transitions if t.id != new.id]
        transitions = tuple(sorted([*others, new], key=lambda t: t.id))
        return snapshot.model_copy(update={"seq": event.seq, "transitions": transitions})
    if isinstance(event, RewindEvent):
        metrics = {name: Series(x=tuple(x for x, _ in kept), y=tuple(y for _, y in kept))
                   for name, series in snapshot.metrics.items()
                   for kept in [[(x, y) for x, y in zip(series.x, series.y) if x <= event.step]]}
        return JobLiveSnapshot(seq=event.seq, metrics=metrics, transitions=snapshot.transitions)
    if isinstance(event, (CheckpointEvent, LogEvent, ExportEvent)):  # their own rows have them: only the seq moves
        return snapshot.model_copy(update={"seq": event.seq})
    metrics = dict(snapshot.metrics)
    for name in METRIC_NAMES:
        value = getattr(event, name)
        if value is not None:
            old = metrics.get(name, Series(x=(), y=()))
            metrics[name] = Series(x=old.x + (float(event.step),), y=old.y + (value,))
    return JobLiveSnapshot(seq=event.seq, metrics=metrics, transitions=snapshot.transitions)
