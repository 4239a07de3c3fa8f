"""Websocket /ws/jobs/<id>/: one job's training metrics, live, to signed-in users."""
from __future__ import annotations

from controlplane.common.consumers import StreamConsumer
from controlplane.jobs.events import job_stream


class JobConsumer(StreamConsumer):
    async def connect(self) -> None:
        self.group = self.stream = job_stream(int(self.scope["url_route"]["kwargs"]["job_id"]))
        await super().connect()
