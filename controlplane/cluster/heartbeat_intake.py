"""The beat's intake of the heartbeats agents posted to Redis (agents/liveness.py): once a
second, take the whole inbox in one transaction, check each heartbeat's seal, and write the
database only for the nodes whose heartbeat says something new (heartbeat_news.py). A steady
cluster costs one Redis round trip, one query of the healthy nodes named, and per node a seal
check and a digest; liveness itself was set by the agent's post."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from datetime import datetime, timezone

from pydantic import ValidationError
from redis.exceptions import LockError, RedisError

from agents import protocol
from agents.liveness import INBOX, RECORDED, TAKEN, entry_read
from controlplane.cluster import services
from controlplane.cluster.agent_auth import heard_from, keys_load, refused
from controlplane.cluster.heartbeat_news import Recorded, content_digest, refresh_due, reported_stats, steady
from controlplane.cluster.host_stats import Shown
from controlplane.cluster.lifecycle import NodeState
from controlplane.cluster.models import Node
from controlplane.common.redis_client import control_redis

log = logging.getLogger(__name__)

# A heartbeat posted more than this many of its intervals before the intake looks is dropped: it
# says nothing about the node now (the control plane was away; the node may have died since).
STALE_INTERVALS = 3
INTAKE_LOCK = "dynaplane:heartbeats:intake"
INTAKE_LOCK_SECONDS = 120.0  # (a worker that died holding it delays the next intake this long at most)


@dataclass(frozen=True, slots=True)
class Intake:
    taken: int  # heartbeats in the inbox
    recorded: int  # written to the database
    steady: int  # nothing new: liveness only
    dropped: int  # refused, malformed or stale
    seconds: float


@dataclass(frozen=True, slots=True)
class _Heard:
    node: str
    at: float  # Redis's clock
    report: dict  # as posted (sealed by its node's key): validated whole only when it is news
    key_id: str


def heartbeats_take(client=None) -> Intake:
    """Take the inbox and record what is new; one intake at a time across the workers' processes
    and threads (another one running: nothing taken, the next beat's intake takes it). Two at once
    could apply a node's older heartbeat after its newer one: at 1,024 nodes an intake that took 57 s
    wrote a node's runs from before a job started over the newer ones, and reconcile failed the job."""
    started = time.perf_counter()
    client = client or control_redis()
    lock = client.lock(INTAKE_LOCK, timeout=INTAKE_LOCK_SECONDS, blocking=False)
    if not lock.acquire():
        log.info("heartbeat intake: another one is running; the next beat takes what it leaves")
        return Intake(0, 0, 0, 0, time.perf_counter() - started)
    try:
        return _take(client, started)
    finally:
        try:
            lock.release()
        except LockError:  # (it outlived INTAKE_LOCK_SECONDS: another may have started meanwhile)
            log.warning("heartbeat intake took more than %.0f s", INTAKE_LOCK_SECONDS)
        except RedisError as exc:  # (the broker went away: the lock expires, what was taken stays recorded)
            log.warning("heartbeat intake: its lock not released (%s); the next intake waits for it to expire, "
                        "%.0f s at most", exc, INTAKE_LOCK_SECONDS)


def _take(client, started: float) -> Intake:
    pipe = client.pipeline(transaction=True)
    pipe.time()
    pipe.hgetall(INBOX)
    pipe.delete(INBOX)
    (seconds, micros), entries, _ = pipe.execute()
    redis_now = seconds + micros / 1e6
    offset = time.time() - redis_now
    heard, dropped, posts = [], 0, []
    for raw_node, raw in entries.items():
        node = raw_node.decode(errors="replace")
        try:
            posts.append((node, *entry_read(raw)))
        except ValueError:
            refused(protocol.CONTROL_AGENT_HEARTBEAT, None, f"the inbox entry of {node!r} is not a heartbeat")
            dropped += 1
    keys_load([seal for *_, seal in posts])
    for node, at, report, seal in posts:
        one = _read(node, at, report, seal, redis_now)
        if one is None:
            dropped += 1
        else:
            heard.append(one)
    if not heard:
        return Intake(len(entries), 0, 0, dropped, time.perf_counter() - started)
    names = [h.node for h in heard]
    recorded = dict(zip(names, client.hmget(RECORDED, names)))
    healthy = dict(Node.objects.filter(name__in=names, state=NodeState.HEALTHY).values_list("name", "id"))
    writes: dict[str, str] = {}
    refresh: dict[int, float] = {}  # row id -> heard at (Redis's clock)
    unchanged = 0
    malformed = set()
    for one in heard:
        digest = content_digest(one.report, one.key_id)
        kept = Recorded.loads(recorded[one.node])
        try:
            stats = reported_stats(one.report)
        except ValueError:
            stats = kept = None  # (not steady: validated whole below, and refused)
        if steady(kept, digest=digest, healthy_id=healthy.get(one.node), stats=stats, heard_at=one.at):
            unchanged += 1
            if refresh_due(kept, one.node, one.at):
                refresh[kept.node_id] = one.at
                writes[one.node] = replace(kept, at=one.at).dumps()
            continue
        try:
            parsed = protocol.AgentHeartbeat.model_validate(one.report)
        except ValidationError as exc:
            log.error("rejected heartbeat %r: %s", one.node, exc)
            malformed.add(one.node)
            continue
        node = services.node_record_heartbeat(report=parsed, key_id=one.key_id,
                                              received_at=datetime.fromtimestamp(one.at + offset, timezone.utc))
        shown = (Shown(node.cpu_percent, node.cpu_count, node.memory_used_bytes, node.memory_total_bytes)
                 if node.host_stats_at is not None else None)  # (what the row shows: maybe an earlier report's)
        writes[one.node] = Recorded(digest, node.pk, shown,
                                    node.host_stats_at.timestamp() - offset if node.host_stats_at else None,
                                    one.at).dumps()
    if refresh:  # (one statement: the rows' last_heartbeat, at the latest of those heard)
        Node.objects.filter(pk__in=list(refresh)).update(
            last_heartbeat=datetime.fromtimestamp(max(refresh.values()) + offset, timezone.utc))
    pipe = client.pipeline(transaction=False)
    if writes:
        pipe.hset(RECORDED, mapping=writes)
    taken = {h.node: h.at for h in heard if h.node not in malformed}
    if taken:
        pipe.zadd(TAKEN, taken)
    pipe.execute()
    return Intake(len(entries), len(writes) - len(refresh), unchanged, dropped + len(malformed),
                  time.perf_counter() - started)


def _read(node: str, at: float, report: dict, seal: object, redis_now: float) -> _Heard | None:
    """The inbox entry (read: at, report, seal) as a heartbeat heard from `node`, or None
    (logged) if it is not one."""
    task = protocol.CONTROL_AGENT_HEARTBEAT
    if report.get("node") != node:
        refused(task, seal, f"the heartbeat of {report.get('node')!r} was posted as {node!r}")
        return None
    interval = report.get("interval_seconds")
    interval = interval if isinstance(interval, (int, float)) and 0 < interval < 3600 else protocol.HEARTBEAT_SECONDS
    if redis_now - at > STALE_INTERVALS * interval:
        return None  # (quietly: after a control-plane outage every node's last one is stale)
    who = heard_from(task, report, seal)
    if who is None:
        return None
    return _Heard(node, at, report, "" if who.is_control_plane else who.key_id)
