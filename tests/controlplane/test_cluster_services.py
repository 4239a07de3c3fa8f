"""Heartbeats register nodes, keep inventory, and the sweep marks silent nodes lost."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from agents import protocol
from controlplane.cluster import services
from controlplane.cluster.events import GpuEvent, NodeEvent
from controlplane.cluster.models import Gpu, Node
from controlplane.cluster.selectors import inventory_counts
from tests.controlplane.conftest import heartbeat, sealed

pytestmark = pytest.mark.django_db


def test_first_heartbeat_registers_node_and_gpus(django_capture_on_commit_callbacks, sent_events) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        services.node_record_heartbeat(report=heartbeat("node-1", gpus=3))
    node = Node.objects.get(name="node-1")
    assert (node.state, node.device, node.gpu_count, node.host) == ("healthy", "cpu", 3, "host-a")
    assert node.gpu_memory_bytes == 3 * 16 * 2**30
    assert list(node.gpus.values_list("index", "state")) == [(0, "free"), (1, "free"), (2, "free")]
    assert [type(e) for e in sent_events] == [NodeEvent, GpuEvent, GpuEvent, GpuEvent]
    assert [e.seq for e in sent_events] == sorted(e.seq for e in sent_events)
    assert len({e.seq for e in sent_events}) == 4


def test_steady_heartbeats_are_silent(django_capture_on_commit_callbacks, sent_events,
                                     django_assert_max_num_queries) -> None:
    services.node_record_heartbeat(report=heartbeat(gpus=8))
    # (savepoint) node lock, node update, the GPUs' inventory as plain values (release)
    with django_capture_on_commit_callbacks(execute=True), django_assert_max_num_queries(5):
        services.node_record_heartbeat(report=heartbeat(gpus=8))
    assert sent_events == []


def test_silent_node_is_lost_then_back(django_capture_on_commit_callbacks, sent_events) -> None:
    t0 = timezone.now()
    services.node_record_heartbeat(report=heartbeat("node-1"), received_at=t0)
    services.node_record_heartbeat(report=heartbeat("node-2"), received_at=t0 + timedelta(seconds=5))
    with django_capture_on_commit_callbacks(execute=True):
        lost = services.nodes_mark_lost(silent_for=timedelta(seconds=6), now=t0 + timedelta(seconds=7))
    assert lost == ["node-1"]
    assert Node.objects.get(name="node-1").state == "lost"
    assert set(Gpu.objects.filter(node__name="node-1").values_list("state", flat=True)) == {"lost"}
    assert set(Gpu.objects.filter(node__name="node-2").values_list("state", flat=True)) == {"free"}
    assert [(type(e).__name__, getattr(e, "node", None) and e.node.state) for e in sent_events[:1]] == [
        ("NodeEvent", "lost")
    ]
    assert [e.gpu.state for e in sent_events[1:]] == ["lost", "lost"]
    assert inventory_counts()["agents"] == {"healthy": 1, "lost": 1}

    sent_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        services.node_record_heartbeat(report=heartbeat("node-1"))
    assert Node.objects.get(name="node-1").state == "healthy"
    assert set(Gpu.objects.filter(node__name="node-1").values_list("state", flat=True)) == {"free"}
    assert [e.type for e in sent_events] == ["node", "gpu", "gpu"]


def test_sweep_leaves_fresh_nodes_alone() -> None:
    services.node_record_heartbeat(report=heartbeat("node-1"))
    assert services.nodes_mark_lost(silent_for=timedelta(seconds=6)) == []


def test_gpus_that_disappear_from_inventory_are_lost() -> None:
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=4))
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2))
    states = dict(Gpu.objects.filter(node__name="node-1").values_list("index", "state"))
    assert states == {0: "free", 1: "free", 2: "lost", 3: "lost"}
    assert Node.objects.get(name="node-1").gpu_count == 2


def test_allocated_gpu_returns_to_its_job_after_outage() -> None:
    from controlplane.jobs.services import job_create

    t0 = timezone.now()
    services.node_record_heartbeat(report=heartbeat("node-1"), received_at=t0)
    job = job_create(name="j", model="tiny-gpt", layout="dp=2")
    Gpu.objects.filter(node__name="node-1").update(job=job, state="allocated")
    services.nodes_mark_lost(silent_for=timedelta(seconds=1), now=t0 + timedelta(seconds=2))
    assert set(Gpu.objects.values_list("state", flat=True)) == {"lost"}
    services.node_record_heartbeat(report=heartbeat("node-1"))
    assert set(Gpu.objects.values_list("state", "job__name")) == {("allocated", "j")}


def test_heartbeat_task_rejects_malformed_reports(caplog) -> None:
    from controlplane.cluster.tasks import agent_heartbeat

    report = heartbeat("node-1").model_dump(mode="json")
    bad = {**report, "gpus": "lots"}
    agent_heartbeat.run(bad, seal=sealed(protocol.CONTROL_AGENT_HEARTBEAT, bad, "node-1"))
    assert not Node.objects.exists()
    assert "rejected heartbeat 'node-1'" in caplog.text
    agent_heartbeat.run(report, seal=sealed(protocol.CONTROL_AGENT_HEARTBEAT, report, "node-1"))
    assert Node.objects.filter(name="node-1", state="healthy").exists()


def test_a_second_agent_with_the_same_name_is_reported(caplog) -> None:
    services.node_record_heartbeat(report=heartbeat("node-1", pid=100, host="host-a"))
    services.node_record_heartbeat(report=heartbeat("node-1", pid=100, host="host-a"))
    assert "give them different --name" not in caplog.text
    services.node_record_heartbeat(report=heartbeat("node-1", pid=200, host="host-b"))
    assert "node node-1: heartbeat from agent pid 200 on host-b, previous one from pid 100 on host-a" in caplog.text
    assert Node.objects.get(name="node-1").host == "host-b"


def test_a_heartbeat_records_what_the_node_runs(client) -> None:
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2, jobs=(
        protocol.RunningJob(job_id=4, ranks=(0, 1)),), emulations=(9,)))
    node = client.get("/api/nodes/node-1").json()
    assert (node["running_jobs"], node["running_emulations"]) == ({"4": [0, 1]}, [9])
    services.node_record_heartbeat(report=heartbeat("node-1", gpus=2))  # its ranks exited
    node = client.get("/api/nodes/node-1").json()
    assert (node["running_jobs"], node["running_emulations"]) == ({}, [])


# --- choosing and locking free GPUs (selectors.gpus_take) --------------------------------------

@pytest.mark.django_db
def test_gpus_take_chooses_again_when_a_chosen_gpu_was_taken_meanwhile(two_nodes) -> None:
    """Optimistic: the choice is made on an unlocked read and the chosen rows are locked after;
    one taken in between (here by the first choice itself, as another scheduler would) makes
    the choice run again on a fresh read, which no longer offers it."""
    from django.db import transaction

    from controlplane.cluster.selectors import gpus_take

    offered = []

    def choose(free: dict[str, list[int]]):
        offered.append({node: list(indices) for node, indices in free.items()})
        pick = [("node-1", free["node-1"][0]), ("node-2", free["node-2"][0])]
        if len(offered) == 1:  # another scheduler takes node-1's GPU 0 before this one locks it
            Gpu.objects.filter(node__name="node-1", index=0).update(state="allocated")
        return "placed", pick

    with transaction.atomic():
        result, rows = gpus_take(choose)
    assert result == "placed" and sorted(rows) == [("node-1", 1), ("node-2", 0)]
    assert offered == [{"node-1": [0, 1], "node-2": [0, 1]}, {"node-1": [1], "node-2": [0, 1]}]
    assert all(row.state == "free" for row in rows.values())  # (locked, not yet given: gpus_allocate does)


@pytest.mark.django_db
def test_gpus_take_gives_up_with_a_conflict_when_the_gpus_keep_changing(two_nodes) -> None:
    from controlplane.cluster.selectors import gpus_take
    from controlplane.common.errors import Conflict

    def choose(free: dict[str, list[int]]):
        node, indices = next(iter(free.items()))
        Gpu.objects.filter(node__name=node, index=indices[0]).update(state="allocated")
        return None, [(node, indices[0])]

    with pytest.raises(Conflict, match="changed under 3 tries"):
        gpus_take(choose, tries=3)
