"""A websocket that relays one event stream to signed-in users: a hello with the stream's
current seq on connect, then every event of the group (see controlplane/common/events.py), in
seq order (seq_order.py: writers in several processes may send them out of order)."""
from __future__ import annotations

import asyncio

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer

from controlplane.common.events import HelloEvent, current_seq
from controlplane.common.seq_order import HOLD_SECONDS, InOrder

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
        self.order, self.hold, self.sending = InOrder(seq), None, asyncio.Lock()
        await self.send_json(HelloEvent(seq=seq).model_dump(mode="json"))

    async def disconnect(self, code: int) -> None:
        if getattr(self, "hold", None) is not None:
            self.hold.cancel()
        await self.channel_layer.group_discard(self.group, self.channel_name)

    async def receive_json(self, content, **kwargs) -> None:
        """The stream is one-way: what clients send is ignored."""

    async def event_message(self, message: dict) -> None:
        await self._relay([message["event"]])

    async def event_batch(self, message: dict) -> None:
        """Several events in one channel-layer message (common/events.py send_many_now):
        one websocket message each, in order, so that pages see no difference."""
        await self._relay(message["events"])

    async def _relay(self, events: list[dict]) -> None:
        order = getattr(self, "order", None)
        if order is None:  # (not connected: nothing to keep in order for)
            return
        async with self.sending:  # (the hold's expiry sends too: one sender at a time keeps the order)
            for event in events:
                for ready in order.arrive(event):
                    await self.send_json(ready)
        if order.waiting and self.hold is None:
            self.hold = asyncio.get_running_loop().call_later(
                HOLD_SECONDS, lambda: asyncio.ensure_future(self._hold_expired()))
        elif not order.waiting and self.hold is not None:
            self.hold.cancel()
            self.hold = None

    async def _hold_expired(self) -> None:
        self.hold = None
        async with self.sending:
            for event in self.order.release():
                await self.send_json(event)
