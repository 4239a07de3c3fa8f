"""Websocket /ws/emulations/: emulation runs' state, progress lines and results, live."""
from __future__ import annotations

from controlplane.common.consumers import StreamConsumer
from controlplane.emulation.events import GROUP, STREAM


class EmulationConsumer(StreamConsumer):
    group, stream = GROUP, STREAM
