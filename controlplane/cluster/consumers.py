"""Websocket /ws/cluster/: the cluster stream's events, live, to signed-in users."""
from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.cluster.events import GROUP, STREAM, HelloEvent
from controlplane.common.events import current_seq

UNAUTHORIZED = 4401


class ClusterConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHORIZED)
            return
        await self.channel_layer.group_add(GROUP, self.channel_name)
        await self.accept()
        seq = await database_sync_to_async(current_seq)(STREAM)
        await self.send_json(HelloEvent(seq=seq).model_dump(mode="json"))

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(GROUP, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        """The stream is one-way: what clients send is ignored."""

    async def event_message(self, message: dict) -> None:
        await self.send_json(message["event"])
