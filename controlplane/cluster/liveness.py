"""When the control plane last heard each node, read from Redis (agents/liveness.py).

Agents set their score in `heard` (Redis's clock) with every heartbeat; the intake sets it in
`taken` once the database reflects that heartbeat. The database's Node.last_heartbeat is written
only when a heartbeat changes the node (or refreshes it), so "last heard" is the later of the
two. Times come back in this process's clock: Redis's shifted by the offset read with them."""
from __future__ import annotations

import time
from datetime import datetime, timezone

from agents.liveness import HEARD, SINCE, TAKEN
from controlplane.common.redis_client import control_redis


def redis_offset(client=None) -> tuple[float, float]:
    """(Redis's time now, this clock minus Redis's), in seconds."""
    client = client or control_redis()
    before = time.time()
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    return now, (before + time.time()) / 2 - now


def last_heard(names: list[str], *, which: str = HEARD, client=None) -> dict[str, datetime]:
    """name -> when Redis last heard it (`which`: HEARD, posted by the agent; TAKEN, in the
    database), for the names it has heard."""
    if not names:
        return {}
    client = client or control_redis()
    _, offset = redis_offset(client)
    scores = client.zmscore(which, names)
    return {name: datetime.fromtimestamp(score + offset, timezone.utc)
            for name, score in zip(names, scores) if score is not None}


def kept_since(client=None) -> datetime:
    """Since when Redis has kept liveness: a node absent from `heard` has not posted since then.
    Absent (Redis restarted or was flushed), it is now: it starts keeping."""
    client = client or control_redis()
    now, offset = redis_offset(client)
    client.set(SINCE, f"{now:.6f}", nx=True)
    return datetime.fromtimestamp(float(client.get(SINCE)) + offset, timezone.utc)


def later(a: datetime | None, b: datetime | None) -> datetime | None:
    return b if a is None else a if b is None else max(a, b)
