from __future__ import annotations

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
    real = events.send_now

    def record(group, event):
        sent.append(event)
        real(group, event)

    monkeypatch.setattr(events, "send_now", record)
    return sent
