"""Heartbeats that cost nearly nothing (issue 47 item 2): agents post to Redis (agents/liveness.py),
the beat takes the inbox once a second and writes the database only for what is new
(controlplane/cluster/heartbeat_intake.py); node loss reads liveness from Redis. Real Redis, real
database; the agent's own poster posts."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from agents import protocol
from agents.liveness import HEARD, INBOX, KEYS, RECORDED, TAKEN, HeartbeatPoster
from agents.seal import seal
from controlplane.cluster import services as cluster
from controlplane.cluster.heartbeat_intake import heartbeats_take
from controlplane.cluster.heartbeat_news import REFRESH_SECONDS, Recorded, refresh_due, steady
from controlplane.cluster.host_stats import Shown
from controlplane.cluster.liveness import last_heard
from controlplane.cluster.models import Gpu, Node
from controlplane.common.redis_client import control_redis
from controlplane.jobs.reconcile import observed
from tests.controlplane.conftest import agent_key, heartbeat

pytestmark = pytest.mark.django_db
STARTED = timezone.now()  # (each agent's start: part of what its row holds)


@pytest.fixture
def poster(settings):
    made = HeartbeatPoster(settings.REDIS_URL)
    yield made
    made.close()


def post(poster: HeartbeatPoster, node: str = "node-1", *, key_node: str | None = None, **fields) -> float:
    """Post `node`'s heartbeat as its agent does, sealed with the key issued for `key_node`."""
    body = heartbeat(node, started_at=STARTED, **fields).model_dump(mode="json")
    signer = key_node or node
    return poster.post(node, body, seal(agent_key(signer), signer, protocol.CONTROL_AGENT_HEARTBEAT, body))


def take(run):
    return run(heartbeats_take)


def stats(cpu: float, used: int = 8 * 2**30) -> dict:
    return {"host_stats": protocol.HostStats(cpu_percent=cpu, cpu_count=8, memory_used_bytes=used,
                                             memory_total_bytes=64 * 2**30)}


def test_a_posted_heartbeat_registers_the_node_and_a_steady_one_writes_nothing(run, poster) -> None:
    posted = post(poster, **stats(10.0))
    intake = take(run)
    assert (intake.taken, intake.recorded, intake.steady, intake.dropped) == (1, 1, 0, 0)
    node = Node.objects.get(name="node-1")
    assert node.state == "healthy" and node.gpu_count == 2 and Gpu.objects.filter(node=node).count() == 2
    written = node.last_heartbeat
    assert abs(written.timestamp() - posted) < 1.0  # (the post's time, in this clock)

    again = post(poster, **stats(11.0))  # same inventory, CPU moved less than a step
    intake = take(run)
    assert (intake.taken, intake.recorded, intake.steady) == (1, 0, 1)
    node.refresh_from_db()
    assert node.last_heartbeat == written and node.cpu_percent == 10.0  # the row was not written
    assert last_heard(["node-1"])["node-1"] > written  # but the node was heard,
    assert last_heard(["node-1"], which=TAKEN)["node-1"].timestamp() == pytest.approx(again, abs=0.5)  # and taken
    assert take(run).taken == 0  # the inbox is empty once taken


def test_what_changes_a_node_is_written(run, poster) -> None:
    post(poster, **stats(10.0))
    take(run)
    post(poster, jobs=(protocol.RunningJob(job_id=7, ranks=(0, 1)),), **stats(10.0))
    assert take(run).recorded == 1
    assert Node.objects.get(name="node-1").running_jobs == {"7": [0, 1]}
    post(poster, jobs=(protocol.RunningJob(job_id=7, ranks=(0, 1)),), **stats(30.0))  # CPU moved 20 points
    assert take(run).recorded == 1
    assert Node.objects.get(name="node-1").cpu_percent == 30.0
    post(poster, gpus=3, jobs=(protocol.RunningJob(job_id=7, ranks=(0, 1)),), **stats(30.0))
    assert take(run).recorded == 1
    assert Node.objects.get(name="node-1").gpu_count == 3


def test_only_the_newest_heartbeat_of_a_node_is_taken(run, poster) -> None:
    for cpu in (10.0, 50.0, 90.0):
        post(poster, **stats(cpu))
    post(poster, "node-2")
    intake = take(run)
    assert (intake.taken, intake.recorded) == (2, 2)
    assert Node.objects.get(name="node-1").cpu_percent == 90.0


def test_a_lost_node_that_beats_again_comes_back_though_its_heartbeat_is_unchanged(run, poster) -> None:
    post(poster)
    take(run)
    Node.objects.filter(name="node-1").update(state="lost")
    Gpu.objects.filter(node__name="node-1").update(state="lost")
    post(poster)
    assert take(run).recorded == 1
    assert Node.objects.get(name="node-1").state == "healthy"
    assert set(Gpu.objects.filter(node__name="node-1").values_list("state", flat=True)) == {"free"}


def test_a_record_from_another_database_is_not_trusted(run, poster) -> None:
    """The Redis record names the row it was written for: a database restored from a backup, or a
    node deleted and registered again, gets its row written."""
    post(poster)
    take(run)
    client = control_redis()
    kept = Recorded.loads(client.hget(RECORDED, "node-1"))
    client.hset(RECORDED, "node-1", Recorded(kept.digest, kept.node_id + 1000, kept.stats, kept.stats_at,
                                             kept.at).dumps())
    post(poster)
    assert take(run).recorded == 1


def test_refused_forged_misnamed_and_stale_heartbeats_are_dropped(run, poster) -> None:
    agent_key("node-2")  # (node-2 enrolled: its key exists)
    post(poster, "node-1", key_node="node-2")  # node-2's agent speaking for node-1
    body = heartbeat("node-3", started_at=STARTED).model_dump(mode="json")
    poster.post("node-3", body, {**seal(agent_key("node-3"), "node-3", protocol.CONTROL_AGENT_HEARTBEAT, body),
                                 "sig": "0" * 64})  # forged
    good = heartbeat("node-4").model_dump(mode="json")
    poster.post("node-5", good, seal(agent_key("node-4"), "node-4", protocol.CONTROL_AGENT_HEARTBEAT, good))  # misfiled
    client = control_redis()
    client.hset(INBOX, "node-6", "12.5 not json")
    post(poster, "node-7")
    at, _, rest = client.hget(INBOX, "node-7").decode().partition(" ")
    client.hset(INBOX, "node-7", f"{float(at) - 3 * protocol.HEARTBEAT_SECONDS - 1:.6f} {rest}")  # posted long ago
    intake = take(run)
    assert (intake.taken, intake.recorded, intake.dropped) == (5, 0, 5)
    assert not Node.objects.exists()


def test_a_node_heard_in_redis_is_not_lost_and_one_silent_there_is(run, poster) -> None:
    post(poster)
    take(run)
    now = timezone.now()
    Node.objects.filter(name="node-1").update(last_heartbeat=now - timedelta(minutes=5))  # the row: long ago
    assert cluster.nodes_mark_lost(silent_for=timedelta(seconds=6), now=now) == []  # Redis heard it just now
    control_redis().zadd(HEARD, {"node-1": control_redis().time()[0] - 60})
    assert cluster.nodes_mark_lost(silent_for=timedelta(seconds=6), now=now) == ["node-1"]
    assert Node.objects.get(name="node-1").state == "lost"


def test_reconcile_sees_when_the_database_last_reflected_a_heartbeat(run, poster) -> None:
    post(poster)
    take(run)
    Node.objects.filter(name="node-1").update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    post(poster)
    take(run)  # steady: only `taken` moves
    assert observed()["node-1"].reported_at > timezone.now() - timedelta(seconds=5)


def test_the_nodes_api_shows_when_a_node_was_last_heard(run, poster, token_client) -> None:
    post(poster)
    take(run)
    Node.objects.filter(name="node-1").update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    for url in ("/api/nodes", "/api/nodes/node-1"):
        response = token_client.get(url)
        shown = response.json()
        shown = shown[0] if isinstance(shown, list) else shown.get("results", [shown])[0]
        heard = timezone.datetime.fromisoformat(shown["last_heartbeat"].replace("Z", "+00:00"))
        assert heard > timezone.now() - timedelta(seconds=5), url


# --- the rule (pure) ---------------------------------------------------------------------------

RECORD = Recorded("d", 1, Shown(10.0, 8, 2**30, 2**36), 100.0, 100.0)


@pytest.mark.parametrize("change, is_steady", [
    ({}, True),
    ({"digest": "e"}, False),  # the content changed
    ({"healthy_id": None}, False),  # lost (or gone)
    ({"healthy_id": 2}, False),  # another row of that name
    ({"heard_at": 99.0}, False),  # heard before it was recorded: a clock step; write
    ({"stats": Shown(20.0, 8, 2**30, 2**36)}, False),  # worth an event
    ({"stats": Shown(11.0, 8, 2**30, 2**36)}, True),
    ({"stats": None}, True),  # no stats sent: the shown ones stay
])
def test_steady_rule(change: dict, is_steady: bool) -> None:
    args = {"digest": "d", "healthy_id": 1, "stats": RECORD.stats, "heard_at": 101.0, **change}
    assert steady(RECORD, **args) is is_steady
    assert steady(None, **args) is False


def test_a_steady_rows_refresh_comes_due_once_per_interval_spread_over_nodes() -> None:
    due = [min(t for t in range(0, 3 * int(REFRESH_SECONDS)) if refresh_due(RECORD, f"node-{n}", RECORD.at + t))
           for n in range(200)]
    assert all(REFRESH_SECONDS <= d <= 2 * REFRESH_SECONDS for d in due)
    assert len(set(due)) > 50  # spread, not all in one intake


def test_records_read_back_and_unreadable_ones_are_none() -> None:
    assert Recorded.loads(RECORD.dumps()) == RECORD
    assert Recorded.loads(Recorded("d", 1, None, None, 5.0).dumps()) == Recorded("d", 1, None, None, 5.0)
    assert Recorded.loads(None) is None and Recorded.loads(b"{") is None and Recorded.loads('{"digest": 1}') is None


def test_nodes_redis_never_heard_are_not_lost_before_it_has_kept_liveness_for_the_silence(run, poster) -> None:
    """Redis restarted or was flushed: what it heard is gone. A node it has no post of is lost
    only once Redis has kept liveness for the whole silence (the node would have posted by then)."""
    post(poster)
    take(run)
    now = timezone.now()
    Node.objects.filter(name="node-1").update(last_heartbeat=now - timedelta(minutes=5))
    client = control_redis()
    client.delete(*KEYS)  # the wipe
    assert cluster.nodes_mark_lost(silent_for=timedelta(seconds=6), now=now) == []
    assert cluster.nodes_mark_lost(silent_for=timedelta(seconds=6), now=now + timedelta(seconds=5)) == []
    assert cluster.nodes_mark_lost(silent_for=timedelta(seconds=6), now=now + timedelta(seconds=7)) == ["node-1"]


def test_a_steady_nodes_row_gets_only_its_last_heartbeat_refreshed_when_due(run, poster) -> None:
    post(poster)
    take(run)
    client = control_redis()
    kept = Recorded.loads(client.hget(RECORDED, "node-1"))
    client.hset(RECORDED, "node-1", Recorded(kept.digest, kept.node_id, kept.stats, kept.stats_at,
                                             kept.at - 2 * REFRESH_SECONDS).dumps())  # recorded long ago
    Node.objects.filter(name="node-1").update(last_heartbeat=timezone.now() - timedelta(minutes=5),
                                               cpu_percent=77.0)
    posted = post(poster)
    intake = take(run)
    assert (intake.recorded, intake.steady) == (0, 1)
    node = Node.objects.get(name="node-1")
    assert abs(node.last_heartbeat.timestamp() - posted) < 1.0 and node.cpu_percent == 77.0  # (only the time)
    assert Recorded.loads(client.hget(RECORDED, "node-1")).at == pytest.approx(posted, abs=0.01)


def test_an_intake_reads_the_agents_keys_in_one_query(run, poster) -> None:
    """1,024 nodes' heartbeats in one intake: their keys are read together, not one query each
    (benchmarks/cluster_scale.py found a query per heartbeat every KEY_CACHE_SECONDS)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from controlplane.cluster.agent_auth import KEYS
    from controlplane.cluster.models import AgentToken

    names = [f"node-{i}" for i in range(1, 31)]
    for name in names:
        post(poster, name)
    KEYS.forget()
    with CaptureQueriesContext(connection) as queries:
        intake = take(run)
    assert (intake.taken, intake.recorded, intake.dropped) == (30, 30, 0)
    table = AgentToken._meta.db_table
    assert sum(table in q["sql"] for q in queries.captured_queries) == 1
    Node.objects.filter(name="node-3").update(state="lost")  # (a node back from lost: written again)
    for name in names:
        post(poster, name)
    KEYS.forget()
    with CaptureQueriesContext(connection) as queries:
        assert take(run).taken == 30
    assert sum(table in q["sql"] for q in queries.captured_queries) == 1


def test_one_intake_at_a_time(run, poster) -> None:
    """While an intake runs (another worker's), a second takes nothing: the next beat's does."""
    from controlplane.cluster.heartbeat_intake import INTAKE_LOCK

    post(poster)
    running = control_redis().lock(INTAKE_LOCK, timeout=30)
    assert running.acquire(blocking=False)
    try:
        assert take(run).taken == 0
    finally:
        running.release()
    assert take(run).taken == 1
