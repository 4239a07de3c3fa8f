"""Task names, queue names and message schemas shared by the control plane and the agents.

Messages are closed (unknown fields are rejected) so that a version skew between an agent
and the control plane fails loudly instead of silently dropping data.
"""
from __future__ import annotations

import re
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

CONTROL_QUEUE = "control"
EMULATE_QUEUE = "emulate"
NODE_QUEUE_PREFIX = "node."

# Tasks the control-plane worker runs (queue "control").
CONTROL_AGENT_HEARTBEAT = "control.agent_heartbeat"
CONTROL_SWEEP_LOST_NODES = "control.sweep_lost_nodes"
CONTROL_EMULATION_PROGRESS = "control.emulation_progress"
# Tasks one agent runs (queue "node.<name>").
NODE_PING = "node.ping"
# Tasks any agent runs (queue "emulate").
EMULATE_RUN = "emulate.run"

# Device profiles the emulator knows (agents/emulator/devices.py; a test keeps them equal).
EMULATOR_DEVICES = ("a100", "h100", "h200", "b200", "cpu")
RECOMPUTE_MODES = ("none", "selective", "full")

HEARTBEAT_SECONDS = 2.0
PROTOCOL_VERSION = 1

NODE_NAME_RE = re.compile(r"^[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?$")

DeviceKind = Literal["cpu", "cuda"]


def validate_node_name(name: str) -> str:
    """Node names become queue names and URL parts: lowercase DNS labels only."""
    if not NODE_NAME_RE.match(name):
        raise ValueError(
            f"node name {name!r} is not a lowercase DNS label (letters, digits, '-', 1-63 chars)"
        )
    return name


def node_queue(name: str) -> str:
    """The Celery queue one agent consumes: node.<name>."""
    return NODE_QUEUE_PREFIX + validate_node_name(name)


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GpuReport(_Message):
    """One accelerator as the agent sees it (a real CUDA device or a virtual CPU one)."""

    index: int = Field(ge=0)
    model_name: str = Field(min_length=1, max_length=128)
    memory_bytes: int = Field(gt=0)
    uuid: str = Field(default="", max_length=128)


class AgentHeartbeat(_Message):
    """Sent by every agent every HEARTBEAT_SECONDS; carries its full inventory so that a
    control plane that lost its database relearns the cluster from heartbeats alone."""

    version: Literal[1] = PROTOCOL_VERSION
    node: str
    host: str = Field(min_length=1, max_length=255)
    device: DeviceKind
    pid: int = Field(gt=0)
    started_at: datetime
    sent_at: datetime
    interval_seconds: float = Field(gt=0, le=60)
    gpus: tuple[GpuReport, ...]

    @field_validator("node")
    @classmethod
    def _node_name(cls, value: str) -> str:
        return validate_node_name(value)

    @field_validator("gpus")
    @classmethod
    def _unique_indices(cls, value: tuple[GpuReport, ...]) -> tuple[GpuReport, ...]:
        indices = [gpu.index for gpu in value]
        if len(set(indices)) != len(indices):
            raise ValueError(f"duplicate GPU indices in inventory: {sorted(indices)}")
        return value


class EmulationOrder(_Message):
    """Control plane -> agent (queue "emulate"): emulate one stored EmulationRun."""

    version: Literal[1] = PROTOCOL_VERSION
    run_id: int = Field(gt=0)
    model: str = Field(min_length=1, max_length=200)
    layout: str = Field(min_length=1, max_length=500)
    gpus: int = Field(gt=0)
    gpu: Literal["a100", "h100", "h200", "b200", "cpu"]
    global_batch: int = Field(gt=0)
    micro_batch: int = Field(gt=0)
    seq: int = Field(gt=0)
    recompute: Literal["none", "selective", "full"] = "none"
    gpus_per_node: int = Field(default=8, gt=0)


class EmulationProgress(_Message):
    """Agent -> control plane (queue "control"): where an emulation run is."""

    version: Literal[1] = PROTOCOL_VERSION
    run_id: int = Field(gt=0)
    state: Literal["running", "done", "failed"]
    message: str = Field(default="", max_length=500)
    result: dict | None = None
    error: str = Field(default="", max_length=4000)
    wall_seconds: float | None = Field(default=None, ge=0)
    agent: str = Field(default="", max_length=63)
