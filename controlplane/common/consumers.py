"""A websocket that relays one event stream to signed-in users: a hello with the stream's
current seq on connect, then every event of the group (see controlplane/common/events.py)."""
from __future__ import annotations

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.common.events import HelloEvent, current_seq

UNAUTHORIZED = 4401


class StreamConsumer(AsyncJsonWebsocketConsumer):
    group: str
    stream: str

    async def connect(self) -> None:
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close(code=UNAUTHORIZED)
            return
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()
        seq = await database_sync_to_async(current_seq)(self.stream)
        await self.send_json(HelloEvent(seq=seq).model_dump(mode="json"))

    async def disconnect(self, code: int) -> None:
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        """The stream is one-way: what clients send is ignored."""

    async def event_message(self, message: dict) -> None:
        await self.send_json(message["event"])

    async def event_batch(self, message: dict) -> None:
        """Several events in one channel-layer message (common/events.py send_many_now):
        one websocket message each, in order, so that pages see no difference."""
        for event in message["events"]:
            await self.send_json(event)
