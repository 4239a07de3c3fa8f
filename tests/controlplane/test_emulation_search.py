"""The compare page's "take the top K from search" through the real broker: POST
/api/emulations/search stores a search run and queues `emulate.search`; an agent's task
body (agents/node/app.py run_search) ranks the candidates and reports them; the control
plane stores the result as the run's. The web process never imports the emulator."""
from __future__ import annotations

import base64
import json
import subprocess
import sys

import pytest
import redis
from celery import Celery
from django.conf import settings

from agents import protocol
from agents.node.config import AgentConfig
from controlplane.emulation import services
from controlplane.emulation.models import EmulationRun
from controlplane.emulation.selectors import emulation_rows, emulation_snapshot

SETTING = {"model": "tiny-gpt", "gpus": 2, "gpu_type": "h100", "global_batch": 8, "micro_batch": 1, "seq_len": 64}


@pytest.fixture
def broker():
    client = redis.Redis.from_url(settings.CELERY_BROKER_URL)
    for queue in (protocol.EMULATE_QUEUE, protocol.CONTROL_QUEUE):
        client.delete(queue)
    yield client
    for queue in (protocol.EMULATE_QUEUE, protocol.CONTROL_QUEUE):
        client.delete(queue)


def _queued(client, queue: str) -> list[tuple[str, dict]]:
    """(task name, first argument) of a Celery queue's messages, oldest first."""
    out = []
    for raw in reversed(client.lrange(queue, 0, -1)):
        envelope = json.loads(raw)
        out.append((envelope["headers"]["task"], json.loads(base64.b64decode(envelope["body"]))[0][0]))
    return out


@pytest.mark.django_db(transaction=True)
def test_a_search_runs_on_an_agent_and_its_ranked_candidates_become_the_runs_result(token_client, broker,
                                                                                     sent_events) -> None:
    response = token_client.post("/api/emulations/search", {**SETTING, "top": 1}, format="json")
    assert response.status_code == 201, response.json()
    run = response.json()
    assert (run["kind"], run["top"], run["layout"], run["state"]) == ("search", 1, "", "queued")
    ((task, order),) = _queued(broker, protocol.EMULATE_QUEUE)
    assert task == protocol.EMULATE_SEARCH
    assert protocol.SearchOrder.model_validate(order).model_dump(include={"run_id", "gpus", "top", "seq"}) == {
        "run_id": run["id"], "gpus": 2, "top": 1, "seq": 64}

    # What the agent's task does with the order, its reports read back from the control queue.
    from agents.node.app import run_search

    agent = Celery("agent-test", broker=settings.CELERY_BROKER_URL, set_as_current=False)
    run_search(agent, AgentConfig(name="node-1", gpus=1, device="cpu", broker_url=settings.CELERY_BROKER_URL), order)
    reports = _queued(broker, protocol.CONTROL_QUEUE)
    assert [task for task, _ in reports] == [protocol.CONTROL_EMULATION_PROGRESS] * 2
    for _, report in reports:
        services.emulation_record_progress(progress=protocol.EmulationProgress.model_validate(report))
    stored = EmulationRun.objects.get(pk=run["id"])
    # tiny-gpt on 2 GPUs with micro-batch 1: 4 layouts the trainer runs, the likeliest fastest
    # first (no model parallelism, ZeRO-3 before ZeRO-1), 3 x top of them for the page to emulate.
    assert (stored.state, stored.result) == ("done", {
        "top": 1, "candidates": 4, "layouts": ["tp=1,pp=1,dp=2,zero=3", "tp=1,pp=1,dp=2,zero=1",
                                               "tp=1,pp=2,dp=1,zero=1"], "dropped": []})
    events = [e for e in sent_events if e.type == "emulation" and e.run.id == run["id"]]
    assert [(e.run.kind, e.run.state) for e in events] == [("search", "queued"), ("search", "running"),
                                                           ("search", "done")]
    assert events[-1].run.result["layouts"] == stored.result["layouts"]
    # A comparison never takes a search in (its figures are of emulations).
    assert emulation_snapshot([stored.pk]).runs == () and emulation_rows([stored.pk]) == []


@pytest.mark.django_db(transaction=True)
def test_a_setting_no_layout_fits_fails_the_search_with_the_reason(broker) -> None:
    run = services.emulation_search_create(config={**SETTING, "model": "llama3-405b", "gpus": 1, "recompute": "none"},
                                           top=2)
    from agents.node.app import run_search

    ((_, order),) = _queued(broker, protocol.EMULATE_QUEUE)
    run_search(Celery("agent-test", broker=settings.CELERY_BROKER_URL, set_as_current=False),
               AgentConfig(name="node-1", gpus=1, device="cpu", broker_url=settings.CELERY_BROKER_URL), order)
    for _, report in _queued(broker, protocol.CONTROL_QUEUE):
        services.emulation_record_progress(progress=protocol.EmulationProgress.model_validate(report))
    run.refresh_from_db()
    assert run.state == "failed"
    assert run.error == ("no layout of llama3-405b runs on 1 GPU with global batch 8 and micro-batch 1 "
                         "(tp=1,pp=1,dp=1,zero=1: static state 6803.6 GiB > 79.6 GiB)")


@pytest.mark.django_db
@pytest.mark.parametrize("changes,message", [
    ({"top": 9}, "Ensure this value is less than or equal to 8"),
    ({"model": "no-such-model"}, "unknown model 'no-such-model'"),
    ({"global_batch": 3, "micro_batch": 2}, "3 is not a multiple of micro_batch 2"),
    ({"gpu_type": "tpu"}, "is not a valid choice"),
])
def test_a_bad_search_is_refused_with_the_field_and_reason(token_client, changes, message) -> None:
    response = token_client.post("/api/emulations/search", {**SETTING, "top": 1, **changes}, format="json")
    assert response.status_code == 400 and message in json.dumps(response.json()), response.json()
    assert EmulationRun.objects.count() == 0


def test_the_web_process_does_not_load_the_emulator_for_a_search() -> None:
    code = ("import django, os, sys; os.environ.setdefault('DJANGO_SETTINGS_MODULE', 'controlplane.settings'); "
            "django.setup(); import controlplane.urls, controlplane.emulation.api, frontend.compare_views; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('parallelism.emulator')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
