"""Issue 44: agents enrolled with tokens, and what they say bound to who they are. Tokens are
issued by staff only and shown once; a joining agent is given its broker; a message is heard only
under a current key's seal, from the node the key was issued for, about a job that node serves;
an order is sealed for one agent's key and no other agent takes it; a revoked key is refused."""
from __future__ import annotations

import logging
from datetime import datetime, timezone

import pytest
from django.contrib.auth import get_user_model
from kombu.exceptions import OperationalError
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from agents import protocol
from agents.node.app import order_refusal
from agents.node.config import AgentConfig
from agents.seal import key_of_token, seal
from controlplane.cluster.agent_auth import KEYS, THROTTLE, control_seal
from controlplane.cluster.agent_tokens import token_issue, token_revoke
from controlplane.cluster.models import AgentToken, Node
from controlplane.cluster.tasks import agent_heartbeat
from controlplane.jobs import orders
from controlplane.jobs.models import Job
from controlplane.jobs.tasks import job_report, job_restore
from tests.support.reports import report_of
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db


@pytest.fixture
def enrolled_on_demand():
    """(Overrides conftest's: here no node is enrolled unless the test enrols it.)"""


@pytest.fixture(autouse=True)
def fresh_keys():
    KEYS.forget()  # (a worker's key cache and log throttle: each test starts from the database)
    THROTTLE.forget()
    yield
    KEYS.forget()


@pytest.fixture
def staff_client(db) -> APIClient:
    admin = get_user_model().objects.create_user("root", password="pw-root-123", is_staff=True)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {Token.objects.create(user=admin).key}")
    return client


def enrol(node: str):
    """A token issued for `node`: its agent's key."""
    return key_of_token(token_issue(node=node, created_by="test")[1])


def beat(node: str, key, claimed: str | None = None) -> dict:
    """Send node `claimed`'s heartbeat sealed with `key` for `node` (the task as the worker runs it)."""
    body = heartbeat(claimed or node).model_dump(mode="json")
    agent_heartbeat(body, seal=seal(key, node, protocol.CONTROL_AGENT_HEARTBEAT, body))
    return body


# --- tokens: issued by staff, shown once ----------------------------------------------------

def test_only_staff_issue_list_and_revoke_tokens(client, token_client, staff_client) -> None:
    for anyone in (client, token_client):
        assert anyone.post("/api/agent-tokens", {"node": "node-1"}, format="json").status_code in (401, 403)
        assert anyone.get("/api/agent-tokens").status_code in (401, 403)
    issued = staff_client.post("/api/agent-tokens", {"node": "node-1", "note": "rack 4"}, format="json")
    assert issued.status_code == 201, issued.json()
    body = issued.json()
    assert body["node"] == "node-1" and key_of_token(body["token"]).key_id == body["key_id"]
    row = AgentToken.objects.get()
    assert body["token"] not in row.secret and row.secret == key_of_token(body["token"]).secret.hex()
    listed = staff_client.get("/api/agent-tokens").json()
    assert [r["key_id"] for r in listed] == [body["key_id"]] and "token" not in listed[0] and "secret" not in listed[0]
    assert token_client.post(f"/api/agent-tokens/{body['key_id']}/revoke").status_code in (401, 403)
    revoked = staff_client.post(f"/api/agent-tokens/{body['key_id']}/revoke")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"]
    assert staff_client.post("/api/agent-tokens/0123456789abcdef/revoke").status_code == 404


@pytest.mark.parametrize("body, field", [({"node": "Node_1"}, "node"), ({}, "node"), ({"node": "n" * 64}, "node"),
                                         ({"node": "node-1", "note": "x" * 201}, "note")])
def test_a_bad_issue_is_a_400_naming_the_field(staff_client, body, field) -> None:
    response = staff_client.post("/api/agent-tokens", body, format="json")
    assert response.status_code == 400 and field in response.json(), response.json()
    assert not AgentToken.objects.exists()


def test_an_agent_joins_with_its_token_and_is_given_its_broker(settings) -> None:
    client = APIClient()
    settings.DYNAPLANE_AGENT_BROKER_URL = "redis://dynaplane:pw@10.0.0.1:6379/0"
    row, token = token_issue(node="node-7")
    joined = client.post("/api/agents/join", {"token": token}, format="json")
    assert joined.status_code == 200
    assert joined.json() == {"node": "node-7", "key_id": row.key_id, "broker_url": settings.DYNAPLANE_AGENT_BROKER_URL}
    assert AgentToken.objects.get().last_joined_at is not None
    wrong_node = client.post("/api/agents/join", {"token": token, "node": "node-8"}, format="json")
    assert wrong_node.status_code == 400 and "speaks for node node-7" in wrong_node.json()["node"][0]
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    assert client.post("/api/agents/join", {"token": forged}, format="json").status_code == 403
    assert client.post("/api/agents/join", {"token": 5}, format="json").status_code == 400
    token_revoke(key_id=row.key_id)
    revoked = client.post("/api/agents/join", {"token": token}, format="json")
    assert revoked.status_code == 403 and "revoked" in revoked.json()["token"][0]


# --- what an agent says ----------------------------------------------------------------------

def test_a_heartbeat_is_heard_only_under_the_seal_of_its_own_nodes_current_key(caplog) -> None:
    key1, key2 = enrol("node-1"), enrol("node-2")
    body = heartbeat("node-1").model_dump(mode="json")
    agent_heartbeat(body)  # no seal
    beat("node-2", key2, claimed="node-1")  # node-2 speaking as node-1
    beat("node-1", key2)  # node-2's key under node-1's name
    agent_heartbeat(body, seal={**seal(key1, "node-1", protocol.CONTROL_AGENT_HEARTBEAT, body), "sig": "0" * 64})
    assert not Node.objects.exists()
    for why in ("no seal", "node node-2 may not speak as 'node-1'", "speaks for node node-2, not node-1",
                "does not match the message"):
        assert why in caplog.text, why
    beat("node-1", key1)
    assert Node.objects.get().key_id == key1.key_id
    token_revoke(key_id=key1.key_id)
    KEYS.forget()  # (or KEY_CACHE_SECONDS later)
    before = Node.objects.get().last_heartbeat
    beat("node-1", key1)
    assert Node.objects.get().last_heartbeat == before and "was revoked" in caplog.text


def test_a_flood_of_refusals_is_logged_once_a_second_with_a_count(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dynaplane.refused")
    body = heartbeat("node-1").model_dump(mode="json")
    for _ in range(50):
        agent_heartbeat(body, seal={"node": "node-1", "key": "ab" * 8, "sig": "0" * 64})
    lines = [r for r in caplog.records if r.name == "dynaplane.refused"]
    assert len(lines) == 1 and "is not a token this control plane issued" in lines[0].getMessage()


def test_a_report_is_heard_only_from_a_node_serving_its_job(two_nodes, token_client, run, sent_tasks, caplog) -> None:
    response = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", "layout": "dp=2"},
                   format="json")
    job = Job.objects.get(pk=response.json()["id"])
    assert {s["node"] for s in job.placement} == {"node-1"}
    stranger = enrol("node-3")
    for node, key in (("node-3", stranger), ("node-2", orders.node_order_key("node-2"))):
        body = report_of(job.pk, "failed", node, ranks=(0,), error="lies").model_dump(mode="json")
        run(job_report, body, seal=seal(key, node, protocol.CONTROL_JOB_REPORT, body))
        assert f"node {node} holds no ranks of job {job.pk}" in caplog.text
    job.refresh_from_db()
    assert (job.state, job.error) == ("starting", "")
    body = report_of(job.pk, "started", "node-1").model_dump(mode="json")
    run(job_report, body)  # sealed by node-1 (conftest's run): it holds the job's ranks
    job.refresh_from_db()
    assert job.state == "running"


def test_only_the_control_plane_queues_a_restore(two_nodes, token_client, run, sent_tasks, caplog) -> None:
    response = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", "layout": "dp=2"},
                   format="json")
    job_id = response.json()["id"]
    job_restore(job_id)  # unsealed
    body = {"job_id": job_id, "early": False}
    job_restore(job_id, seal=seal(orders.node_order_key("node-2"), "node-2", protocol.CONTROL_JOB_RESTORE, body))
    assert "only the control plane queues restores" in caplog.text and "no seal" in caplog.text
    assert Job.objects.get(pk=job_id).state == "starting"
    job_restore(job_id, seal=control_seal(protocol.CONTROL_JOB_RESTORE, body))  # heard (not restoring: a no-op)
    assert "refused control.job_restore" not in caplog.text.split("only the control plane")[-1]


# --- what an agent is told -------------------------------------------------------------------

def test_an_order_is_sealed_for_one_agent_and_refused_by_any_other(two_nodes, sent_tasks, monkeypatch) -> None:
    sent = []
    monkeypatch.setattr(orders.app, "send_task", lambda name, args=None, kwargs=None, queue=None, **_: sent.append(
        (name, args[0], kwargs["seal"], queue)))
    key1 = orders.node_order_key("node-1")
    orders.send(protocol.NODE_JOB_STOP, "node-1", protocol.JobStopOrder(job_id=7))
    ((task, order, sealed, queue),) = sent
    assert queue == "node.node-1"
    config = AgentConfig(name="node-1", gpus=1, device="cpu", broker_url="redis://x", key=key1)
    assert order_refusal(config, task, order, sealed) is None
    other = AgentConfig(name="node-2", gpus=1, device="cpu", broker_url="redis://x", key=orders.node_order_key("node-2"))
    assert "sealed for node node-1" in order_refusal(other, task, order, sealed)
    assert "forged or altered" in order_refusal(config, task, {**order, "job_id": 8}, sealed)
    assert "no seal" in order_refusal(config, task, order, None)
    assert "takes no orders" in order_refusal(AgentConfig(name="node-1", gpus=1, device="cpu", broker_url="x"),
                                              task, order, sealed)


def test_orders_follow_the_key_the_agent_speaks_with_and_stop_when_it_is_revoked(monkeypatch) -> None:
    old, new = enrol("node-1"), enrol("node-1")
    beat("node-1", old)  # the agent still runs with its first token
    assert orders.node_order_key("node-1") == old
    token_revoke(key_id=old.key_id)
    assert orders.node_order_key("node-1") == new  # (its newest: an agent restarted with it takes the orders)
    token_revoke(key_id=new.key_id)
    monkeypatch.setattr(orders.app, "send_task", lambda *a, **k: pytest.fail("an order was sent"))
    with pytest.raises(OperationalError, match="node node-1 has no unrevoked agent key"):
        orders.send(protocol.NODE_JOB_STOP, "node-1", protocol.JobStopOrder(job_id=1))


def test_the_launcher_reissues_its_local_agents_tokens(settings, tmp_path) -> None:
    import json
    from io import StringIO

    from django.core.management import call_command

    settings.VAR_DIR = tmp_path
    admin_issued = enrol("node-2")
    first = json.loads(_bootstrap(call_command, StringIO, agents=2))["agent_tokens"]
    second = json.loads(_bootstrap(call_command, StringIO, agents=2))["agent_tokens"]
    assert set(first) == set(second) == {"node-1", "node-2"} and first != second
    live = set(AgentToken.objects.filter(revoked_at=None).values_list("key_id", flat=True))
    assert live == {key_of_token(t).key_id for t in second.values()} | {admin_issued.key_id}
    assert datetime.now(timezone.utc) >= AgentToken.objects.exclude(revoked_at=None).first().revoked_at


def _bootstrap(call_command, buffer, agents: int) -> str:
    out = buffer()
    call_command("dynaplane_bootstrap", "--agents", str(agents), stdout=out)
    return out.getvalue().strip().splitlines()[-1]


# --- the Agents page -------------------------------------------------------------------------

def test_the_agents_page_is_for_staff_and_lists_tokens_without_their_secrets(browser_client, staff_client) -> None:
    from django.test import Client

    row, token = token_issue(node="gpu-7", note="rack 4")
    beat("gpu-7", key_of_token(token))
    assert Client().get("/agents/").status_code == 302  # to sign in
    assert browser_client.get("/agents/").status_code == 302  # signed in, not staff: to the admin sign-in
    assert '<a href="/agents/">Agents</a>' not in browser_client.get("/datasets/").content.decode()
    staff = Client()
    staff.force_login(get_user_model().objects.get(username="root"))
    html = staff.get("/agents/").content.decode()
    assert f'id="token-{row.key_id}"' in html and "in use" in html and "rack 4" in html
    assert token.split("_")[2] not in html and row.secret not in html
    assert '<a href="/agents/">Agents</a>' in html


def test_keys_that_come_due_are_read_again_together(monkeypatch) -> None:
    """A worker's cache reads every key that is due in the one query a due key causes (200 rank
    zeros' keys came due one by one: a query per report batch), and still sees a revocation."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from controlplane.cluster import agent_auth

    keys = {f"node-{i}": enrol(f"node-{i}") for i in range(1, 6)}
    for key in keys.values():
        assert KEYS.get(key.key_id)[0] in keys
    clock = [agent_auth.time.monotonic() + agent_auth.KEY_CACHE_SECONDS + 1]
    monkeypatch.setattr(agent_auth.time, "monotonic", lambda: clock[0])
    token_revoke(key_id=keys["node-3"].key_id)
    with CaptureQueriesContext(connection) as queries:
        entries = {node: KEYS.get(key.key_id) for node, key in keys.items()}
    assert len(queries.captured_queries) == 1
    assert {node: entry[2] for node, entry in entries.items()} == {
        "node-1": False, "node-2": False, "node-3": True, "node-4": False, "node-5": False}
    assert KEYS.get("f" * 16) is None  # an id no token has
