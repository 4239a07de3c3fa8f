"""Who said it (issue 44): every message an agent puts on the control queue carries a seal
(agents/seal.py); here the seal is checked against the agent's stored key and the message bound
to the node the key was issued for. The control plane's own queued tasks are sealed with a key
derived from SECRET_KEY. Refusals are logged (throttled: a flood must not fill the log)."""
from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass

from django.conf import settings

from agents.seal import AgentKey, SealError, seal, seal_read, seal_valid
from controlplane.cluster.models import AgentToken

log = logging.getLogger("dynaplane.refused")

# A revoked token's messages are refused at most this long after the revocation (each worker
# keeps the keys it read this long: a lookup per message would cost a query per heartbeat).
KEY_CACHE_SECONDS = 5.0
MAX_KEYS_READ = 5000  # keys read in one query at most
CONTROL_PLANE = "control-plane"  # the name in the control plane's own seals
CONTROL_KEY_ID = "0" * 16  # token key ids are random 64-bit values: never all zeros (agent_tokens.py)


class Refused(Exception):
    """A message that is not what an enrolled agent (or the control plane) said."""


@dataclass(frozen=True, slots=True)
class Speaker:
    node: str  # the node the key was issued for, or CONTROL_PLANE
    key_id: str

    @property
    def is_control_plane(self) -> bool:
        return self.key_id == CONTROL_KEY_ID


def control_key() -> AgentKey:
    return AgentKey(CONTROL_KEY_ID, hashlib.sha256(b"dynaplane control plane\x00" + settings.SECRET_KEY.encode()).digest())


def control_seal(task: str, body: object) -> dict:
    """The seal on a task the control plane queues for itself."""
    return seal(control_key(), CONTROL_PLANE, task, body)


class _Keys:
    """key id -> (node, secret, revoked), read from the database at most every KEY_CACHE_SECONDS."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rows: dict[str, tuple[float, tuple[str, bytes, bool] | None]] = {}

    def get(self, key_id: str) -> tuple[str, bytes, bool] | None:
        """The key, read again with every other cached key that is due (one query for all: at
        200 jobs each rank 0's key came due every KEY_CACHE_SECONDS, a query per report batch)."""
        now = time.monotonic()
        with self._lock:
            cached = self._rows.get(key_id)
            if cached is not None and now - cached[0] < KEY_CACHE_SECONDS:
                return cached[1]
            due = {k for k, (at, _) in self._rows.items() if now - at >= KEY_CACHE_SECONDS} if cached else set()
        return self._read({key_id} | set(list(due)[:MAX_KEYS_READ - 1]), now).get(key_id)

    def load(self, key_ids: set[str]) -> None:
        """Read the keys of `key_ids` that are not cached (or are older than KEY_CACHE_SECONDS)
        in one query: an intake of a thousand heartbeats must not ask for them one by one."""
        now = time.monotonic()
        with self._lock:
            stale = {k for k in key_ids if k not in self._rows or now - self._rows[k][0] >= KEY_CACHE_SECONDS}
        stale.discard(CONTROL_KEY_ID)
        if stale:
            self._read(stale, now)

    def _read(self, stale: set[str], now: float) -> dict[str, tuple[str, bytes, bool]]:
        """Read `stale` from the database into the cache (an id with no token: None); returns what was found."""
        rows = {key_id: (node, bytes.fromhex(secret), revoked is not None) for key_id, node, secret, revoked in
                AgentToken.objects.filter(key_id__in=stale).values_list("key_id", "node", "secret", "revoked_at")}
        with self._lock:
            if len(self._rows) + len(stale) > 100_000:  # unknown ids sent by a flood must not grow it without bound
                self._rows.clear()
            for key_id in stale:
                self._rows[key_id] = (now, rows.get(key_id))
        return rows

    def forget(self) -> None:
        with self._lock:
            self._rows.clear()


KEYS = _Keys()


def keys_load(seals: list[object]) -> None:
    """Have the keys that sealed `seals` at hand (one query for those not cached): before
    checking many messages at once. Seals that cannot be read are left to speaker() to refuse."""
    ids = set()
    for received in seals:
        try:
            ids.add(seal_read(received).key_id)
        except SealError:
            continue
    KEYS.load(ids)


def speaker(task: str, body: object, received: object) -> Speaker:
    """Who sealed `body` for `task`; Refused (saying why) unless a current key did."""
    try:
        parsed = seal_read(received)
    except SealError as exc:
        raise Refused(str(exc)) from None
    if parsed.key_id == CONTROL_KEY_ID:
        if parsed.node != CONTROL_PLANE or not seal_valid(control_key().secret, parsed, task, body):
            raise Refused("not sealed by this control plane")
        return Speaker(CONTROL_PLANE, CONTROL_KEY_ID)
    entry = KEYS.get(parsed.key_id)
    if entry is None:
        raise Refused(f"key {parsed.key_id} is not a token this control plane issued")
    node, secret, revoked = entry
    if revoked:
        raise Refused(f"key {parsed.key_id} of node {node} was revoked")
    if parsed.node != node:
        raise Refused(f"key {parsed.key_id} speaks for node {node}, not {parsed.node}")
    if not seal_valid(secret, parsed, task, body):
        raise Refused(f"the seal of key {parsed.key_id} does not match the message (forged or altered)")
    return Speaker(node, parsed.key_id)


class _Throttle:
    """At most one log line per (task, sender, why) a second; the rest counted into the next line."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[tuple[str, str, str], tuple[float, int]] = {}

    def refused(self, task: str, who: str, why: str) -> None:
        now = time.monotonic()
        with self._lock:
            last, skipped = self._last.get((task, who, why), (0.0, 0))
            if now - last < 1.0:
                self._last[(task, who, why)] = (last, skipped + 1)
                return
            if len(self._last) > 10_000:
                self._last.clear()
            self._last[(task, who, why)] = (now, 0)
        more = f" (and {skipped} more like it)" if skipped else ""  # (counted up to this one's second)
        log.warning("refused %s from %s: %s%s", task, who, why, more)


    def forget(self) -> None:
        with self._lock:
            self._last.clear()


THROTTLE = _Throttle()


def refused(task: str, received: object, why: str) -> None:
    """Log a refusal (who claimed to send it is the seal's node, when it has one)."""
    who = received.get("node") if isinstance(received, dict) else None
    THROTTLE.refused(task, repr(who)[:70] if who is not None else "an unsealed sender", why)


def heard_from(task: str, body: dict, received: object, *, node_field: str = "node") -> Speaker | None:
    """The speaker when `body` is sealed by an agent key whose node is `body[node_field]` (or by
    the control plane); else None, after logging why the message was refused."""
    try:
        who = speaker(task, body, received)
    except Refused as exc:
        refused(task, received, str(exc))
        return None
    if not who.is_control_plane and body.get(node_field) != who.node:
        refused(task, received, f"node {who.node} may not speak as {body.get(node_field)!r}")
        return None
    return who
