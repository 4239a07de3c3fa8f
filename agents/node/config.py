"""Agent configuration: one frozen value built from the command line, passed around."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import datetime, timezone

from agents import protocol
from agents.seal import AgentKey


@dataclass(frozen=True, slots=True)
class AgentConfig:
    name: str
    gpus: int
    device: protocol.DeviceKind
    broker_url: str
    heartbeat_seconds: float = protocol.HEARTBEAT_SECONDS
    virtual_gpu_memory_bytes: int | None = None  # None: host RAM / gpus
    host: str = field(default_factory=socket.gethostname)
    key: AgentKey | None = None  # from its token (agents/seal.py); None: its messages are refused, it takes no order
    started_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))

    def __post_init__(self) -> None:
        protocol.validate_node_name(self.name)
        if self.gpus < 1 and self.device == "cpu":
            raise ValueError(f"--gpus {self.gpus}: a CPU agent needs at least one virtual GPU")
        if self.heartbeat_seconds <= 0:
            raise ValueError(f"heartbeat interval {self.heartbeat_seconds} must be > 0")

    @property
    def queue(self) -> str:
        return protocol.node_queue(self.name)

    @property
    def pid(self) -> int:
        return os.getpid()
