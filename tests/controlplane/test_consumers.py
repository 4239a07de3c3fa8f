"""/ws/cluster/ through the real ASGI app and the real Redis channel layer."""
from __future__ import annotations

import pytest
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from rest_framework.authtoken.models import Token

from controlplane.asgi import application
from controlplane.cluster import services
from controlplane.cluster.events import cluster_event_adapter
from controlplane.jobs.services import job_create
from tests.controlplane.conftest import heartbeat

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.asyncio]

ORIGIN = (b"origin", b"http://localhost")


def _communicator(headers: list[tuple[bytes, bytes]]) -> WebsocketCommunicator:
    return WebsocketCommunicator(application, "/ws/cluster/", headers=[ORIGIN, (b"host", b"localhost"), *headers])


async def test_anonymous_socket_is_refused() -> None:
    communicator = _communicator([])
    connected, code = await communicator.connect()
    assert not connected and code == 4401


async def test_events_reach_a_token_client(user) -> None:
    key = (await database_sync_to_async(Token.objects.create)(user=user)).key
    communicator = _communicator([(b"authorization", f"Token {key}".encode())])
    connected, _ = await communicator.connect()
    assert connected
    hello = cluster_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    assert (hello.type, hello.op) == ("hello", "connected")

    await database_sync_to_async(services.node_record_heartbeat)(report=heartbeat("node-7", gpus=1))
    node_event = cluster_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    gpu_event = cluster_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    assert (node_event.type, node_event.node.name, node_event.seq) == ("node", "node-7", hello.seq + 1)
    assert (gpu_event.type, gpu_event.gpu.key, gpu_event.gpu.state, gpu_event.seq) == ("gpu", "node-7/0", "free",
                                                                                       hello.seq + 2)

    await database_sync_to_async(job_create)(name="wsjob", model="tiny-gpt", layout="dp=1")
    job_event = cluster_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    assert (job_event.type, job_event.op, job_event.job.name, job_event.seq) == ("job", "upsert", "wsjob",
                                                                                  hello.seq + 3)
    await communicator.disconnect()


async def test_wrong_origin_is_refused(user) -> None:
    communicator = WebsocketCommunicator(application, "/ws/cluster/",
                                         headers=[(b"origin", b"http://evil.example"), (b"host", b"localhost")])
    connected, _ = await communicator.connect()
    assert not connected


async def test_a_batch_of_step_events_reaches_a_job_page_one_message_each(user) -> None:
    """One channel-layer message for a batch of steps (ingest.py); the socket relays each
    event as its own message, in seq order, as pages expect."""

    from agents import protocol
    from tests.support.reports import report_of
    from controlplane.jobs.events import job_event_adapter
    from controlplane.jobs.ingest import batch_ingest
    from controlplane.jobs.models import Job

    key = (await database_sync_to_async(Token.objects.create)(user=user)).key
    job = await database_sync_to_async(job_create)(name="batched", model="tiny-gpt", layout="dp=1")
    await database_sync_to_async(Job.objects.filter(pk=job.pk).update)(state="running")
    communicator = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=[
        ORIGIN, (b"host", b"localhost"), (b"authorization", f"Token {key}".encode())])
    connected, _ = await communicator.connect()
    assert connected
    hello = job_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    await database_sync_to_async(batch_ingest)(batch=protocol.ReportBatch(
        job_id=job.pk, node="node-1", stream="s", batch=1, reports=tuple(
            report_of(job.pk, "step", step=s, loss=1.0 / s)
            for s in range(1, 6))))
    events = [job_event_adapter.validate_python(await communicator.receive_json_from(timeout=5)) for _ in range(5)]
    assert [(e.type, e.step, e.seq) for e in events] == [("metrics", s, hello.seq + s) for s in range(1, 6)]
    await communicator.disconnect()


async def test_events_sent_out_of_order_reach_the_page_in_seq_order(user) -> None:
    """Two workers send their events after their own commits: n+1 can reach the channel layer
    before n. The socket holds n+1 until n comes, or for seq_order.HOLD_SECONDS if n was lost."""
    from channels.layers import get_channel_layer

    from controlplane.cluster.consumers import ClusterConsumer

    key = (await database_sync_to_async(Token.objects.create)(user=user)).key
    communicator = _communicator([(b"authorization", f"Token {key}".encode())])
    assert (await communicator.connect())[0]
    hello = (await communicator.receive_json_from(timeout=5))["seq"]
    layer, group = get_channel_layer(), ClusterConsumer.group

    async def send(*seqs: int) -> None:
        events = [{"type": "test", "seq": hello + s} for s in seqs]
        await layer.group_send(group, {"type": "event.batch", "events": events} if len(events) > 1
                               else {"type": "event.message", "event": events[0]})

    await send(2)
    await send(3, 4)
    assert await communicator.receive_nothing(timeout=0.2)  # held: 1 has not come
    await send(1)
    assert [(await communicator.receive_json_from(timeout=5))["seq"] - hello for _ in range(4)] == [1, 2, 3, 4]
    await send(6)  # 5 is lost
    assert await communicator.receive_nothing(timeout=0.2)
    assert (await communicator.receive_json_from(timeout=5))["seq"] - hello == 6  # after the hold
    await communicator.disconnect()
