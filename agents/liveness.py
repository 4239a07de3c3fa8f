"""Heartbeats posted straight to Redis (issue 47): the keys both sides use and the agent's post.

A heartbeat as a Celery task cost the control worker a task's overhead plus a locked read and a
write of the node's row, per node, every 2 s: at 1,024 nodes more than one worker process has.
Instead an agent posts its sealed heartbeat with one Redis script that, in Redis's own clock,

- replaces the node's entry in the inbox hash (only the newest heartbeat of a node matters), and
- sets the node's score in the `heard` sorted set: liveness, which costs the control plane
  nothing until a sweep reads it.

The control plane takes the whole inbox once a second in one transaction
(controlplane/cluster/heartbeat_intake.py) and writes the database only for a node whose
heartbeat says something new. Both clocks are Redis's, so hosts' clocks never compare.
"""
from __future__ import annotations

import json

INBOX = "dynaplane:heartbeats:inbox"  # hash: node -> "<redis time> <{"report":..,"seal":..}>"
HEARD = "dynaplane:heartbeats:heard"  # sorted set: node -> redis time of its last heartbeat
TAKEN = "dynaplane:heartbeats:taken"  # sorted set: node -> redis time of the last heartbeat the database reflects
RECORDED = "dynaplane:heartbeats:recorded"  # hash: node -> what the database last recorded (intake's)
# Redis time since when these keys have been kept (set by the lost-node sweep when absent): a node
# missing from `heard` has not posted since then, but may have before (Redis restarted, flushed).
SINCE = "dynaplane:heartbeats:since"
KEYS = (INBOX, HEARD, TAKEN, RECORDED, SINCE)

# KEYS[1] inbox, KEYS[2] heard; ARGV[1] node, ARGV[2] the sealed heartbeat as JSON.
POST_SCRIPT = """
local t = redis.call('TIME')
local now = string.format('%d.%06d', t[1], t[2])
redis.call('HSET', KEYS[1], ARGV[1], now .. ' ' .. ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
return now
"""


def entry_body(report: dict, seal: dict | None) -> str:
    return json.dumps({"report": report, "seal": seal}, separators=(",", ":"))


def entry_read(raw: bytes | str) -> tuple[float, dict, object]:
    """(redis time posted, report, seal) of an inbox entry; ValueError if it is not one."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    at, _, body = text.partition(" ")
    parsed = json.loads(body)
    if not isinstance(parsed, dict) or not isinstance(parsed.get("report"), dict):
        raise ValueError("not a heartbeat entry")
    return float(at), parsed["report"], parsed.get("seal")


class HeartbeatPoster:
    """An agent's connection for its heartbeats: `post(node, report, seal)` -> the redis time.
    Raises redis's ConnectionError/TimeoutError (OSError-like) when the broker is away."""

    def __init__(self, broker_url: str) -> None:
        import redis  # (the agents' Celery transport already depends on it)

        self._client = redis.Redis.from_url(broker_url, socket_timeout=5, socket_connect_timeout=3)
        self._post = self._client.register_script(POST_SCRIPT)

    def post(self, node: str, report: dict, seal: dict | None) -> float:
        return float(self._post(keys=[INBOX, HEARD], args=[node, entry_body(report, seal)]))

    def close(self) -> None:
        self._client.close()
