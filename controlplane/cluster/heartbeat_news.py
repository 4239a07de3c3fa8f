"""Whether a node's heartbeat says anything the database does not hold yet (pure: no I/O).

A steady node beats every 2 s with the same inventory and the same runs; only its host stats
and clock move. The intake (heartbeat_intake.py) keeps, per node, what it last recorded in the
database (`Recorded`, in Redis) and writes the node again only when the heartbeat's content
differs, its host stats are worth an event (host_stats.py), the node is not the healthy row
recorded (lost, deleted, or the database is not the one it recorded in). A steady node's row
gets only its last_heartbeat refreshed, every REFRESH_SECONDS to twice that (spread by node, so
nodes registered together do not all come due in one intake): one UPDATE for all that are due."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, astuple, dataclass

from pydantic import ValidationError

from agents.protocol import HostStats
from controlplane.cluster.host_stats import Shown, worth_showing

REFRESH_SECONDS = 60.0


def content_digest(report: dict, key_id: str) -> str:
    """What the node row holds of a heartbeat, as posted (its JSON): all of it but its clock and
    its host stats. Read from the post itself so that a steady heartbeat is never parsed whole
    (validating 512 heartbeats of 8 GPUs a second was most of the intake's time)."""
    body = {name: value for name, value in report.items() if name not in ("sent_at", "host_stats")}
    return hashlib.sha256(json.dumps([body, key_id], sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def reported_stats(report: dict) -> Shown | None:
    """The heartbeat's host stats (validated); ValueError when they are not host stats."""
    raw = report.get("host_stats")
    if raw is None:
        return None
    try:
        stats = HostStats.model_validate(raw)
    except ValidationError as exc:
        raise ValueError(str(exc)) from None
    return Shown(stats.cpu_percent, stats.cpu_count, stats.memory_used_bytes, stats.memory_total_bytes)


@dataclass(frozen=True, slots=True)
class Recorded:
    """What the intake last wrote for a node: its content digest, the row's id, the host stats the
    row shows and when they were reported, and when it was written (times: Redis's clock)."""

    digest: str
    node_id: int
    stats: Shown | None
    stats_at: float | None
    at: float

    def dumps(self) -> str:
        stats = None if self.stats is None else astuple(self.stats)
        return json.dumps({**asdict(self), "stats": stats}, separators=(",", ":"))

    @classmethod
    def loads(cls, raw: bytes | str | None) -> Recorded | None:
        if raw is None:
            return None
        try:
            fields = json.loads(raw)
            stats = fields.get("stats")
            stats_at = fields.get("stats_at")
            return cls(str(fields["digest"]), int(fields["node_id"]), Shown(*stats) if stats else None,
                       None if stats_at is None else float(stats_at), float(fields["at"]))
        except (ValueError, TypeError, KeyError):
            return None  # (written by another version: record again)


def steady(recorded: Recorded | None, *, digest: str, healthy_id: int | None, stats: Shown | None,
           heard_at: float) -> bool:
    """True when the heartbeat heard at `heard_at` adds nothing to what was recorded; then only
    its liveness (already in Redis) is new. `healthy_id`: the node's row id if it is healthy."""
    if recorded is None or healthy_id is None or recorded.node_id != healthy_id or recorded.digest != digest:
        return False
    if heard_at < recorded.at:  # (a clock step: write)
        return False
    since = None if recorded.stats_at is None else heard_at - recorded.stats_at
    return not worth_showing(recorded.stats, stats, since)


def refresh_due(recorded: Recorded, node: str, heard_at: float) -> bool:
    """Whether a steady node's row is due a new last_heartbeat (REFRESH_SECONDS plus the node's
    own share of it, so that nodes registered together come due spread over an interval)."""
    share = int.from_bytes(hashlib.sha256(node.encode()).digest()[:4], "big") / 2**32
    return heard_at - recorded.at >= REFRESH_SECONDS * (1 + share)
