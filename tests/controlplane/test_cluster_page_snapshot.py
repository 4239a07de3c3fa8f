"""The cluster page's snapshot (issue 47: the page at thousands of GPUs): GPUs in the compact
form (frontend/cluster_compact.py), the same content and seq as the API's snapshot, on the
page and from the reload endpoint the page uses after a gap (signed in only)."""
from __future__ import annotations

import json

import pytest

from controlplane.cluster import services
from controlplane.cluster.events import ClusterSnapshot
from controlplane.cluster.selectors import cluster_snapshot
from frontend.cluster_compact import expand_gpus
from tests.controlplane.conftest import embedded_json, heartbeat

pytestmark = pytest.mark.django_db


def _as_snapshot(page: dict) -> ClusterSnapshot:
    return ClusterSnapshot(seq=page["seq"], nodes=page["nodes"], gpus=expand_gpus(page["gpus"]), jobs=page["jobs"])


def test_the_page_and_its_reload_hold_the_apis_snapshot(run, token_client, browser_client, client) -> None:
    for n in range(1, 4):
        run(services.node_record_heartbeat, report=heartbeat(f"node-{n}", gpus=4))
    run(token_client.post, "/api/jobs", {"name": "held", "model": "tiny-gpt", "gpus": 2}, format="json")
    run(token_client.post, "/api/jobs", {"name": "waiting", "model": "tiny-gpt", "gpus": 2, "start": False},
        format="json")
    expected = cluster_snapshot()
    assert any(g.job == "held" for g in expected.gpus)

    page = embedded_json(browser_client.get("/").content.decode(), "cluster-snapshot")
    assert set(page["gpus"]) == {"tables", "rows"} and len(page["gpus"]["rows"]) == 12
    assert _as_snapshot(page).canonical() == expected.canonical() and page["seq"] == expected.seq
    reloaded = browser_client.get("/cluster/snapshot.json")
    assert reloaded["content-type"] == "application/json"
    assert _as_snapshot(reloaded.json()).canonical() == expected.canonical()
    states = embedded_json(browser_client.get("/").content.decode(), "cluster-states")
    assert states["gpu"] == ["free", "allocated", "draining", "lost"] and "running" in states["job"]

    assert client.get("/cluster/snapshot.json").status_code == 302  # signed out: to the login page


def test_thousands_of_gpus_stay_small(run, browser_client) -> None:
    """64 nodes x 8 GPUs: the compact GPUs are a fraction of the dicts they stand for."""
    for n in range(1, 65):
        services.node_record_heartbeat(report=heartbeat(f"node-{n}", gpus=8))
    page = json.loads(browser_client.get("/cluster/snapshot.json").content)
    compact = len(json.dumps(page["gpus"]))
    full = len(json.dumps(expand_gpus(page["gpus"])))
    assert len(page["gpus"]["rows"]) == 512 and compact * 4 < full, (compact, full)
