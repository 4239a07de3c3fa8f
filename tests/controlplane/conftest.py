from __future__ import annotations

import threading
from datetime import datetime, timezone

import pytest
from django.contrib.auth import get_user_model
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from agents import protocol
from agents.node.inventory import virtual_gpus


def heartbeat(node: str = "node-1", gpus: int = 2, **overrides) -> protocol.AgentHeartbeat:
    now = datetime.now(timezone.utc)
    fields = dict(node=node, host="host-a", device="cpu", pid=1234, started_at=now, sent_at=now,
                  interval_seconds=2.0, gpus=virtual_gpus(gpus, memory_bytes=16 * 2**30))
    fields.update(overrides)
    return protocol.AgentHeartbeat(**fields)


def agent_key(node: str):
    """The key of a token issued for `node` (agents/seal.py), as an admin would have issued one
    before its agent joined: the one its orders are sealed with."""
    from agents.seal import key_of_token
    from controlplane.cluster.agent_tokens import node_order_key, token_issue

    return node_order_key(node) or key_of_token(token_issue(node=node, created_by="test")[1])


def sealed(task: str, body: dict, node: str) -> dict:
    """The seal `node`'s agent puts on `body` for `task`."""
    from agents.seal import seal

    return seal(agent_key(node), node, task, body)


@pytest.fixture
def user(db):
    return get_user_model().objects.create_user("alice", password="pw-alice-123")


@pytest.fixture
def token_client(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=user).key}")
    return client


@pytest.fixture
def sent_events(monkeypatch) -> list:
    """Events as they leave for the channel layer (after commit), in order."""
    from controlplane.common import events

    sent: list = []
    real, real_many = events.send_now, events.send_many_now

    def record(group, event):
        sent.append(event)
        real(group, event)

    def record_many(group, batch):
        sent.extend(batch)
        real_many(group, batch)

    monkeypatch.setattr(events, "send_now", record)
    monkeypatch.setattr(events, "send_many_now", record_many)
    return sent


# Jobs on the agents (scheduling, resize): the sent Celery tasks are the one thing captured.
@pytest.fixture
def sent_tasks(monkeypatch) -> list[tuple[str, dict, str]]:
    """(task name, message, queue) of every task the control plane sends."""
    from controlplane.celery import app

    sent: list[tuple[str, dict, str]] = []
    lock = threading.Lock()

    def record(name, args=None, queue=None, **kwargs):
        with lock:
            sent.append((name, args[0], queue))

    monkeypatch.setattr(app, "send_task", record)
    return sent


@pytest.fixture
def two_nodes():
    """node-1 on host-1 and node-2 on host-2, two GPUs each."""
    from controlplane.cluster import services as cluster

    for i in (1, 2):
        cluster.node_record_heartbeat(report=heartbeat(f"node-{i}", gpus=2, host=f"host-{i}"))
        agent_key(f"node-{i}")  # (its agent is enrolled: orders to it are sealed)


AGENT_TASKS = {protocol.CONTROL_JOB_REPORT, protocol.CONTROL_TRANSITION_REPORT, protocol.CONTROL_INGEST_EVENTS,
               protocol.CONTROL_JOB_LOG, protocol.CONTROL_AGENT_HEARTBEAT, protocol.CONTROL_EMULATION_PROGRESS,
               protocol.CONTROL_PREFLIGHT_REPORT}


@pytest.fixture
def run(django_capture_on_commit_callbacks):
    """Call fn(...) and run its on-commit callbacks (events, orders), as a commit would. A task
    the agents send is called as the agent sends it: sealed by the node its message names."""
    def call(fn, *args, **kwargs):
        if getattr(fn, "name", None) in AGENT_TASKS and args and isinstance(args[0], dict) and "seal" not in kwargs:
            node = args[0].get("node") or args[0].get("agent")
            if isinstance(node, str) and protocol.NODE_NAME_RE.match(node):
                kwargs["seal"] = sealed(fn.name, args[0], node)
        with django_capture_on_commit_callbacks(execute=True):
            return fn(*args, **kwargs)
    return call


@pytest.fixture(autouse=True)
def _no_preflight(settings):
    """The agents these tests play answer no pre-flight (their nodes are on hosts of their own):
    the orders go out at once. test_jobs_preflight.py turns it on and plays the agents' part."""
    settings.DYNAPLANE_PREFLIGHT = "off"


@pytest.fixture(autouse=True)
def _fresh_speaker_caches():
    """The workers' caches of keys and of which node serves which job, empty for each test: a
    job id of one test is another job in the next (SQLite counts ids again from 1)."""
    from controlplane.cluster.agent_auth import KEYS, THROTTLE
    from controlplane.jobs.job_speakers import SERVED

    for cache in (KEYS, THROTTLE, SERVED):
        cache.forget()
    yield


@pytest.fixture(autouse=True)
def _fresh_liveness():
    """No node heard in Redis (agents/liveness.py) but by the test itself: the keys outlive a
    test's database, and a node name of one test is another node in the next."""
    from agents.liveness import KEYS, SINCE
    from controlplane.common.redis_client import control_redis

    control_redis().delete(*KEYS)
    control_redis().set(SINCE, "0")  # (Redis has kept liveness all along: a node's silence is its row's)


@pytest.fixture(autouse=True)
def enrolled_on_demand(request, monkeypatch):
    """Every node these tests give orders to was enrolled by an admin (its orders sealed with its
    key): a token is issued for it the first time. tests/controlplane/test_agent_auth.py, which
    tests enrolment itself, turns this off by defining a fixture of the same name."""
    if "django_db_setup" not in request.fixturenames and not request.node.get_closest_marker("django_db"):
        return
    from controlplane.jobs import orders

    real = orders.node_order_key
    monkeypatch.setattr(orders, "node_order_key", lambda node: real(node) or agent_key(node))


@pytest.fixture
def browser_client(user):
    """A signed-in browser session (the pages' authentication), as opposed to token_client."""
    from django.test import Client

    client = Client()
    client.force_login(user)
    return client


def embedded_json(html: str, element_id: str):
    """The JSON a page embeds in <script id=element_id type="application/json">."""
    import json
    import re

    found = re.search(rf'<script id="{element_id}" type="application/json">(.*?)</script>', html, re.S)
    assert found, element_id
    return json.loads(found.group(1))


@pytest.fixture
def data_root(settings, tmp_path):
    """An empty DYNAPLANE_DATA_ROOT of the test's own (the dataset tests register under it)."""
    root = tmp_path / "data"
    root.mkdir()
    settings.DYNAPLANE_DATA_ROOT = str(root)
    return root
