"""POST /api/emulations queues runs on the agents' `emulate` queue (the real broker);
agents' progress reports move a run through its states and out on /ws/emulations/."""
from __future__ import annotations

import base64
import json

import pytest
import redis
from channels.db import database_sync_to_async
from channels.testing import WebsocketCommunicator
from django.conf import settings
from rest_framework.authtoken.models import Token

from agents import protocol
from controlplane.asgi import application
from controlplane.emulation import services
from controlplane.emulation.events import emulation_event_adapter
from controlplane.emulation.models import EmulationRun

CONFIG = {"model": "tiny-gpt", "layout": "tp=2,pp=2,dp=2,zero=1", "gpus": 8, "gpu_type": "h100",
          "global_batch": 16, "micro_batch": 2, "seq_len": 32}


@pytest.fixture
def emulate_queue():
    """The broker's `emulate` list, emptied before and after."""
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    client.delete(protocol.EMULATE_QUEUE)
    yield client
    client.delete(protocol.EMULATE_QUEUE)


def emulate_orders(client) -> list[dict]:
    bodies = [json.loads(m) for m in client.lrange(protocol.EMULATE_QUEUE, 0, -1)]
    return [json.loads(base64.b64decode(b["body"]))[0][0] for b in bodies]


@pytest.mark.django_db(transaction=True)
def test_posting_configurations_stores_and_queues_one_run_each(token_client, emulate_queue) -> None:
    other = {**CONFIG, "layout": "tp=1,pp=2,dp=4,zero=3", "gpu_type": "a100"}
    response = token_client.post("/api/emulations", {"configs": [CONFIG, other]}, format="json")
    assert response.status_code == 201, response.json()
    runs = response.json()["runs"]
    assert [r["state"] for r in runs] == ["queued", "queued"]
    assert [r["layout"] for r in runs] == ["tp=2,pp=2,dp=2,zero=1", "tp=1,pp=2,dp=4,zero=3"]
    orders = sorted(emulate_orders(emulate_queue), key=lambda o: o["run_id"])
    assert [o["run_id"] for o in orders] == [r["id"] for r in runs]
    order = protocol.EmulationOrder.model_validate(orders[1])
    assert (order.gpu, order.seq, order.micro_batch, order.gpus) == ("a100", 32, 2, 8)

    single = token_client.post("/api/emulations", CONFIG, format="json")  # one object is one run
    assert single.status_code == 201 and len(single.json()["runs"]) == 1
    listed = token_client.get("/api/emulations").json()
    assert listed["count"] == 3


@pytest.mark.django_db
@pytest.mark.parametrize("changes,field,message", [
    ({"gpus": 6}, "configs[0]", "needs 8 GPUs, not 6"),
    ({"layout": "tp=3,dp=2"}, "configs[0]", "tp=3 does not divide 4 attention heads"),
    ({"global_batch": 10}, "configs[0]", "global_batch: global_batch=10 is not a multiple of micro_batch=2 x dp=2"),
    ({"gpu_type": "tpu"}, "configs", "is not a valid choice"),
    ({"model": "no-such-model"}, "configs[0]", "no-such-model"),
])
def test_bad_configurations_are_refused_with_the_field_and_reason(token_client, changes, field, message) -> None:
    response = token_client.post("/api/emulations", {**CONFIG, **changes}, format="json")
    assert response.status_code == 400
    assert message in json.dumps(response.json())
    assert EmulationRun.objects.count() == 0


@pytest.mark.django_db
def test_writes_need_a_token(client) -> None:
    assert client.post("/api/emulations", CONFIG, content_type="application/json").status_code in (401, 403)


@pytest.mark.django_db(transaction=True)
def test_progress_moves_a_run_and_a_late_report_cannot_reopen_it(sent_events, emulate_queue) -> None:
    (run,) = services.emulation_create(configs=[{**CONFIG, "recompute": "none"}])
    services.emulation_record_progress(progress=protocol.EmulationProgress(run_id=run.pk, state="running",
                                                                           message="traced stage class 1/2"))
    run.refresh_from_db()
    assert (run.state, run.message) == ("running", "traced stage class 1/2")
    services.emulation_record_progress(progress=protocol.EmulationProgress(
        run_id=run.pk, state="done", result={"step_seconds": 1.5}, wall_seconds=3.0))
    services.emulation_record_progress(progress=protocol.EmulationProgress(run_id=run.pk, state="running"))
    run.refresh_from_db()
    assert (run.state, run.result, run.wall_seconds) == ("done", {"step_seconds": 1.5}, 3.0)
    assert run.finished_at is not None
    seqs = [e.seq for e in sent_events if e.type == "emulation"]
    assert [e.run.state for e in sent_events if e.type == "emulation"] == ["queued", "running", "done"]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3


@pytest.mark.django_db(transaction=True)
def test_a_failed_run_keeps_the_reason(emulate_queue) -> None:
    (run,) = services.emulation_create(configs=[{**CONFIG, "recompute": "none"}])
    services.emulation_record_progress(progress=protocol.EmulationProgress(run_id=run.pk, state="failed",
                                                                           error="cannot trace: cp=2"))
    run.refresh_from_db()
    assert (run.state, run.error) == ("failed", "cannot trace: cp=2")


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_emulation_events_reach_a_websocket_client(user, emulate_queue) -> None:
    key = (await database_sync_to_async(Token.objects.create)(user=user)).key
    communicator = WebsocketCommunicator(application, "/ws/emulations/", headers=[
        (b"origin", b"http://localhost"), (b"host", b"localhost"), (b"authorization", f"Token {key}".encode())])
    connected, _ = await communicator.connect()
    assert connected
    hello = emulation_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    assert hello.type == "hello"
    (run,) = await database_sync_to_async(services.emulation_create)(configs=[{**CONFIG, "recompute": "none"}])
    event = emulation_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    assert (event.type, event.run.id, event.run.state) == ("emulation", run.pk, "queued")
    assert event.seq == hello.seq + 1
    await communicator.disconnect()


def test_the_protocol_lists_the_emulators_devices() -> None:
    from parallelism.emulator.devices import PROFILES

    assert set(protocol.EMULATOR_DEVICES) == set(PROFILES)
