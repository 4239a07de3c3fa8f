"""Live events: closed schemas, a sequence number per stream, sent after commit.

Every server->browser event has `type`, `op` and `seq`. A page embeds a snapshot taken
at some seq and applies events with larger seqs; a gap (seq != last + 1) makes the page
fetch a fresh snapshot. Sequence numbers are allocated inside the writing transaction
(row lock on the stream's counter), so their order is the commit order.
"""
from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Literal

from django.db import connection, transaction
from django.db.models import F
from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError

from controlplane.common.layer_sends import group_send
from controlplane.common.models import EventStream

log = logging.getLogger(__name__)


class Closed(BaseModel):
    """Base of every event and view model: unknown fields are rejected."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class HelloEvent(Closed):
    """First message on a new connection to any stream: the stream's current seq."""

    type: Literal["hello"] = "hello"
    op: Literal["connected"] = "connected"
    seq: int


def next_seq(stream: str) -> int:
    """Allocate the next sequence number of `stream`; call inside transaction.atomic()."""
    return next_seqs(stream, 1).start


def next_seqs(stream: str, count: int) -> range:
    """Allocate `count` consecutive sequence numbers of `stream` (a batch of events); call
    inside transaction.atomic(). One statement in the common case (UPDATE ... RETURNING,
    PostgreSQL and SQLite >= 3.35): every live event pays for it, so it is kept to one
    round trip."""
    assert count > 0
    table = connection.ops.quote_name(EventStream._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(f"UPDATE {table} SET seq = seq + %s WHERE name = %s RETURNING seq", [count, stream])
        row = cursor.fetchone()
    if row is None:
        EventStream.objects.get_or_create(name=stream)
        EventStream.objects.filter(name=stream).update(seq=F("seq") + count)
        row = (EventStream.objects.values_list("seq", flat=True).get(name=stream),)
    last = int(row[0])
    return range(last - count + 1, last + 1)


def next_seqs_of(counts: Mapping[str, int]) -> dict[str, range]:
    """next_seqs for several streams in one statement (the report batches of many jobs applied
    together); call inside transaction.atomic(), holding the locks of the jobs the streams are of
    (two transactions that allocate for one stream are then one after the other)."""
    names = sorted(name for name, count in counts.items() if count > 0)
    if not names:
        return {}
    table = connection.ops.quote_name(EventStream._meta.db_table)
    rows = ", ".join(["(%s, %s)"] * len(names))
    params = [v for name in names for v in (name, int(counts[name]))]
    with connection.cursor() as cursor:
        # (a CTE of VALUES and a correlated subquery: the one form both PostgreSQL and SQLite take)
        cursor.execute(f"WITH wanted (name, n) AS (VALUES {rows}) "
                       f"UPDATE {table} SET seq = seq + (SELECT n FROM wanted WHERE wanted.name = {table}.name) "
                       f"WHERE name IN (SELECT name FROM wanted) RETURNING name, seq", params)
        last = {name: int(seq) for name, seq in cursor.fetchall()}
    out = {name: range(seq - counts[name] + 1, seq + 1) for name, seq in last.items()}
    for name in names:
        if name not in out:  # a stream's first events
            out[name] = next_seqs(name, counts[name])
    return out


def current_seq(stream: str) -> int:
    return EventStream.objects.filter(name=stream).values_list("seq", flat=True).first() or 0


def send_now(group: str, event: Closed) -> None:
    """Send one event to a channel-layer group. A broker outage loses the live event,
    never the write: clients notice the seq gap and reload their snapshot."""
    _group_send(group, {"type": "event.message", "event": event.model_dump(mode="json")},
                f"event {event.__class__.__name__}")


def send_many_now(group: str, events: list[Closed]) -> None:
    """Send events to a group as one channel-layer message (consumers relay them one by
    one, in order: StreamConsumer.event_batch): one Redis round trip for a batch."""
    _group_send(group, {"type": "event.batch", "events": [event.model_dump(mode="json") for event in events]},
                f"{len(events)} events")


def _group_send(group: str, message: dict, what: str) -> None:
    try:
        group_send(group, message)
    except (RedisError, OSError) as exc:  # (TimeoutError is an OSError)
        log.warning("%s to %s not delivered: %s", what, group, exc)


def publish_on_commit(group: str, event: Closed) -> None:
    transaction.on_commit(lambda: send_now(group, event))


def publish_many_on_commit(group: str, events: list[Closed]) -> None:
    if events:
        transaction.on_commit(lambda: send_many_now(group, list(events)))
