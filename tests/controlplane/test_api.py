"""REST API: auth, validation (400 with field messages), 404, 409, schema, health."""
from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from controlplane.cluster import services
from controlplane.jobs.models import Job
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db


def test_health_reports_database_broker_and_agents() -> None:
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2))
    response = APIClient().get("/api/health")
    assert response.status_code == 200
    body = response.json()
    assert body["status"] == "ok"
    assert body["database"]["ok"] and body["broker"]["ok"]
    assert body["agents"] == {"healthy": 1, "lost": 0}
    assert body["gpus"]["total"] == 2 and body["gpus"]["free"] == 2


def test_health_says_degraded_when_broker_is_down(settings) -> None:
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = APIClient().get("/api/health")
    assert response.status_code == 503
    assert response.json()["status"] == "degraded"
    assert response.json()["broker"]["ok"] is False


def test_schema_lists_the_resources() -> None:
    response = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json")
    assert response.status_code == 200
    paths = response.json()["paths"]
    for path in ["/api/health", "/api/nodes", "/api/gpus", "/api/jobs", "/api/jobs/{id}", "/api/transitions",
                 "/api/emulations"]:
        assert path in paths, path


def test_the_schema_shows_open_reads_without_a_lock_and_writes_with_one() -> None:
    """Reads anyone may make (open reads, the default here) need no security in the schema, so
    Swagger UI draws no lock on them; writes, and reads only staff may make, keep theirs."""
    paths = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    assert paths["/api/jobs"]["get"]["security"] == [] and paths["/api/nodes"]["get"]["security"] == []
    assert {"tokenAuth": []} in paths["/api/jobs"]["post"]["security"]
    assert {} not in paths["/api/jobs"]["post"]["security"]
    assert paths["/api/agent-tokens"]["get"]["security"] and {} not in paths["/api/agent-tokens"]["get"]["security"]


def test_writes_need_a_token(user) -> None:
    response = APIClient().post("/api/jobs", {"name": "j", "model": "tiny-gpt", "layout": "dp=2"}, format="json")
    assert response.status_code == 401
    assert not Job.objects.exists()


def test_create_read_list_delete(token_client) -> None:
    created = token_client.post("/api/jobs", {"name": "j1", "model": "tiny-gpt", "layout": "tp=2, dp=2",
                                              "start": False}, format="json")
    assert created.status_code == 201, created.content
    body = created.json()
    assert (body["layout"], body["world_size"], body["state"]) == ("tp=2,dp=2", 4, "pending")
    assert token_client.get(f"/api/jobs/{body['id']}").json()["name"] == "j1"
    assert [j["name"] for j in token_client.get("/api/jobs").json()["results"]] == ["j1"]
    assert token_client.delete(f"/api/jobs/{body['id']}").status_code == 204
    assert token_client.get(f"/api/jobs/{body['id']}").status_code == 404


@pytest.mark.parametrize(
    ("payload", "field", "fragment"),
    [
        ({"model": "tiny-gpt", "layout": "dp=2"}, "name", "required"),
        ({"name": "bad name!", "model": "tiny-gpt", "layout": "dp=2"}, "name", "slug"),
        ({"name": "j", "model": "", "layout": "dp=2"}, "model", "blank"),
        ({"name": "j", "model": "tiny-gpt", "layout": "tp=3,ep=2"}, "layout", "ep=2 must divide dp*cp=1"),
        ({"name": "j", "model": "tiny-gpt", "layout": "zero=9"}, "layout", "zero=9 must be 0, 1, 2 or 3"),
        ({"name": "j", "model": "tiny-gpt", "layout": "dp=2", "global_batch": 0}, "global_batch", "greater than"),
        ({"name": "j", "model": "tiny-gpt", "layout": "dp=2", "global_batch": 6, "micro_batch": 4}, "global_batch",
         "not a multiple of micro_batch=4"),
    ],
)
def test_invalid_job_gets_field_level_400(token_client, payload, field, fragment) -> None:
    response = token_client.post("/api/jobs", payload, format="json")
    assert response.status_code == 400
    errors = response.json()
    assert field in errors, errors
    assert any(fragment in message for message in errors[field]), errors
    assert not Job.objects.exists()


def test_duplicate_name_is_a_field_error(token_client) -> None:
    job = {"name": "j", "model": "tiny-gpt", "layout": "dp=1", "start": False}
    assert token_client.post("/api/jobs", job, format="json").status_code == 201
    response = token_client.post("/api/jobs", job, format="json")
    assert response.status_code == 400
    assert "already exists" in response.json()["name"][0]


def test_unknown_ids_are_404(token_client) -> None:
    assert token_client.get("/api/jobs/999").status_code == 404
    assert token_client.delete("/api/jobs/999").status_code == 404
    assert token_client.get("/api/nodes/nope").status_code == 404
    assert token_client.get("/api/transitions/5").status_code == 404


def test_deleting_a_running_job_is_a_conflict(token_client) -> None:
    job_id = token_client.post("/api/jobs", {"name": "j", "model": "tiny-gpt", "layout": "dp=1", "start": False},
                               format="json").json()["id"]
    Job.objects.filter(pk=job_id).update(state="running")
    response = token_client.delete(f"/api/jobs/{job_id}")
    assert response.status_code == 409
    assert "running" in response.json()["detail"] and "stop it first" in response.json()["detail"]
    assert Job.objects.filter(pk=job_id).exists()


def test_nodes_and_gpus_are_listed_and_filtered(token_client) -> None:
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2))
    services.node_record_heartbeat(report=heartbeat("node-2", gpus=1))
    nodes = token_client.get("/api/nodes").json()["results"]
    assert [(n["name"], len(n["gpus"])) for n in nodes] == [("node-1", 2), ("node-2", 1)]
    gpus = token_client.get("/api/gpus?node=node-2").json()["results"]
    assert [(g["node"], g["index"], g["state"]) for g in gpus] == [("node-2", 0, "free")]
    bad = token_client.get("/api/gpus?state=melted")
    assert bad.status_code == 400 and "state" in bad.json()


def test_cluster_snapshot_endpoint(token_client) -> None:
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2))
    body = token_client.get("/api/cluster/snapshot").json()
    assert body["seq"] == 3
    assert [n["name"] for n in body["nodes"]] == ["node-1"] and len(body["gpus"]) == 2


@pytest.mark.parametrize("path", ["/api/docs/", "/api/redoc/"])
def test_the_interactive_api_docs_load_only_files_of_this_server(path) -> None:
    """Swagger UI and ReDoc from drf-spectacular-sidecar: every script and stylesheet the page
    loads is a path of this server (its static files; ReDoc's bundle through api_docs.py, with
    its one remote address taken out), and each is there. (In a browser with the network
    blocked: tests/browser/test_api_docs_offline.py.)"""
    import re

    from django.test import Client

    client = Client()
    response = client.get(path)
    assert response.status_code == 200 and response["Content-Type"].startswith("text/html")
    html = response.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', html)
    assert assets and all(a.startswith("/") and not a.startswith("//") for a in assets), assets
    assert "fonts.googleapis.com" not in html
    assert "/api/schema/" in html
    for asset in assets:
        served = client.get(asset)
        assert served.status_code == 200, asset
        assert b"cdn.redoc.ly" not in b"".join(served.streaming_content if served.streaming else [served.content])
        served.close()
