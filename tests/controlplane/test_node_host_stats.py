"""Node CPU and memory (issue 28): when a heartbeat's host stats replace the shown ones
(controlplane/cluster/host_stats.py, a pure rule with properties), what the service stores
and sends, the API's fields and the cluster page's snapshot."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import given
from hypothesis import strategies as st

from agents import protocol
from controlplane.cluster import services
from controlplane.cluster.events import NodeEvent
from controlplane.cluster.host_stats import CPU_STEP, MEMORY_STEP, REFRESH_SECONDS, Shown, worth_showing
from controlplane.cluster.models import Node
from tests.controlplane.conftest import embedded_json, heartbeat

GIB = 2**30
shown_stats = st.builds(Shown, st.floats(0, 100), st.integers(1, 256), st.integers(0, 64 * GIB), st.just(64 * GIB))


@given(shown=shown_stats, reported=shown_stats, since=st.floats(0, 3600))
def test_the_rule_shows_big_changes_at_once_and_any_change_after_the_refresh(shown, reported, since) -> None:
    show = worth_showing(shown, reported, since)
    big = (abs(reported.cpu_percent - shown.cpu_percent) >= CPU_STEP or reported.cpu_count != shown.cpu_count
           or abs(reported.memory_used_bytes - shown.memory_used_bytes) >= MEMORY_STEP * reported.memory_total_bytes)
    if reported == shown:
        assert not show  # nothing to send
    elif big:
        assert show
    else:
        assert show == (since >= REFRESH_SECONDS)
    assert worth_showing(None, reported, None) and not worth_showing(shown, None, since)


@pytest.mark.django_db
def test_host_stats_are_shown_with_an_event_and_small_moves_wait(django_capture_on_commit_callbacks,
                                                                 sent_events) -> None:
    t0 = timezone.now()

    def beat(cpu: float, used_gib: float, at: float) -> list:
        sent_events.clear()
        stats = protocol.HostStats(cpu_percent=cpu, cpu_count=16, memory_used_bytes=int(used_gib * GIB),
                                   memory_total_bytes=64 * GIB)
        with django_capture_on_commit_callbacks(execute=True):
            services.node_record_heartbeat(report=heartbeat(host_stats=stats), received_at=t0 + timedelta(seconds=at))
        return [e for e in sent_events if isinstance(e, NodeEvent)]

    services.node_record_heartbeat(report=heartbeat(), received_at=t0)  # an agent without stats
    assert Node.objects.get().cpu_percent is None
    first = beat(40.0, 10, 2)
    assert [(e.node.cpu_percent, e.node.memory_used_bytes, e.node.cpu_count) for e in first] == [(40.0, 10 * GIB, 16)]
    assert beat(42.0, 10.1, 4) == []  # a small move: no event, the shown values stay
    assert (Node.objects.get().cpu_percent, Node.objects.get().memory_used_bytes) == (40.0, 10 * GIB)
    assert [e.node.cpu_percent for e in beat(90.0, 10.1, 6)] == [90.0]  # 50 points: at once
    assert [e.node.memory_used_bytes for e in beat(90.0, 20, 8)] == [20 * GIB]
    assert beat(91.0, 20, 10) == []
    assert [e.node.cpu_percent for e in beat(91.0, 20, 8 + REFRESH_SECONDS)] == [91.0]  # the refresh
    sent_events.clear()
    with django_capture_on_commit_callbacks(execute=True):  # a beat without stats keeps the shown ones
        services.node_record_heartbeat(report=heartbeat(), received_at=t0 + timedelta(seconds=60))
    assert sent_events == [] and Node.objects.get().cpu_percent == 91.0


@pytest.mark.django_db
def test_the_api_and_the_cluster_page_show_them(token_client, browser_client) -> None:
    stats = protocol.HostStats(cpu_percent=37.5, cpu_count=8, memory_used_bytes=3 * GIB, memory_total_bytes=16 * GIB)
    services.node_record_heartbeat(report=heartbeat(host_stats=stats))
    node = token_client.get("/api/nodes/node-1").json()
    assert (node["cpu_percent"], node["cpu_count"], node["memory_used_bytes"], node["memory_total_bytes"]) == (
        37.5, 8, 3 * GIB, 16 * GIB) and node["host_stats_at"]
    snapshot = embedded_json(browser_client.get("/").content.decode(), "cluster-snapshot")
    assert snapshot["nodes"][0]["cpu_percent"] == 37.5 and snapshot["nodes"][0]["memory_total_bytes"] == 16 * GIB


@pytest.mark.django_db
def test_the_job_page_carries_its_nodes_host_stats(run, token_client, browser_client, sent_tasks) -> None:
    """The job page's grid draws the host line (format.js hostStats, twin of
    formatting.host_stats) from the cluster snapshot it embeds, on the nodes the job holds."""
    from controlplane.jobs.reports import job_record_report
    from frontend.formatting import host_stats
    from tests.support.reports import report_of

    stats = protocol.HostStats(cpu_percent=37.5, cpu_count=8, memory_used_bytes=3 * GIB, memory_total_bytes=16 * GIB)
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2, host_stats=stats))
    services.node_record_heartbeat(report=heartbeat("node-2", gpus=2))  # no stats reported yet
    job = run(token_client.post, "/api/jobs", {"name": "hosted", "model": "tiny-gpt", "gpus": 2}, format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    snapshot = embedded_json(browser_client.get(f"/jobs/{job['id']}/").content.decode(), "cluster-snapshot")
    nodes = {n["name"]: n for n in snapshot["nodes"]}
    held = {g["node"] for g in snapshot["gpus"] if g["job"] == "hosted"}
    assert held == {"node-1"}
    one = nodes["node-1"]
    assert host_stats(one["cpu_percent"], one["cpu_count"], one["memory_used_bytes"], one["memory_total_bytes"]) == \
        "CPU 37.5 % of 8 · mem 3.00 GiB / 16.0 GiB"
    assert host_stats(*(nodes["node-2"][k] for k in ("cpu_percent", "cpu_count", "memory_used_bytes",
                                                     "memory_total_bytes"))) == ""
