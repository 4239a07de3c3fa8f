"""Closed event schemas of the emulations stream: a run's state, progress and result."""
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
    state: Literal["queued", "running", "done", "failed"]
    message: str
    error: str
    result: dict | None
    wall_seconds: float | None


class EmulationEvent(Closed):
    type: Literal["emulation"] = "emulation"
    op: Literal["upsert"] = "upsert"
    seq: int
    run: EmulationView


emulation_event_adapter: TypeAdapter = TypeAdapter(
    Annotated[Union[EmulationEvent, HelloEvent], Field(discriminator="type")])
