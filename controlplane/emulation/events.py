"""Closed event schemas of the emulations stream: a run's state, progress and result, and
the pure snapshot arithmetic apply_emulation_event(snapshot, event) -> snapshot."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from controlplane.common.events import Closed, HelloEvent

STREAM = "emulations"
GROUP = "emulations"


class EmulationView(Closed):
    id: int
    model: str
    layout: str
    gpus: int
    gpu_type: str
    global_batch: int
    micro_batch: int
    seq_len: int
    recompute: str
    state: Literal["queued", "running", "done", "failed"]
    message: str
    error: str
    result: dict | None
    wall_seconds: float | None
    kind: Literal["emulate", "search"] = "emulate"  # search: result = {top, candidates, layouts, dropped}
    top: int | None = None


class EmulationEvent(Closed):
    type: Literal["emulation"] = "emulation"
    op: Literal["upsert"] = "upsert"
    seq: int
    run: EmulationView


emulation_event_adapter: TypeAdapter = TypeAdapter(
    Annotated[Union[EmulationEvent, HelloEvent], Field(discriminator="type")])


class EmulationSnapshot(Closed):
    """The runs a page follows (`ids`, in the page's order), consistent with `seq` of the
    emulations stream. Runs in `ids` that do not exist are left out of `runs`."""

    seq: int
    ids: tuple[int, ...]
    runs: tuple[EmulationView, ...]


def apply_emulation_event(snapshot: EmulationSnapshot, event: EmulationEvent | HelloEvent) -> EmulationSnapshot:
    """The snapshot after one event. Events at or below its seq are already in it; events
    of runs the snapshot does not follow only move its seq."""
    if isinstance(event, HelloEvent) or event.seq <= snapshot.seq:
        return snapshot
    runs = snapshot.runs
    if event.run.id in snapshot.ids:
        by_id = {run.id: run for run in runs} | {event.run.id: event.run}
        runs = tuple(by_id[i] for i in snapshot.ids if i in by_id)
    return snapshot.model_copy(update={"seq": event.seq, "runs": runs})
