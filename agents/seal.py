"""Agent identity: tokens, the keys they give, and the seals on every message (pure; stdlib only).

An admin issues each agent a token (`dpa_<key id>_<secret>`), shown once. The agent and the
control plane both hold the key derived from it (the control plane keeps only the key, never
the token). Everything an agent sends on the control queue carries a seal: its node, its key id
and an HMAC-SHA256 over (node, task, body) with that key; every order the control plane puts on
an agent's queue carries one made with that agent's key. A message without a valid seal is
refused and logged; a sealed one is bound to the node that sealed it (controlplane/cluster/
agent_auth.py checks that the node serves the job it speaks of).

Why not Celery's own message signing (celery.security, the "auth" serializer): it signs with
one X.509 key pair and certificate store for the whole cluster and never tells the task who
signed, so a task cannot bind a message to the agent that sent it, nor can one agent's access
be revoked. Here each agent has its own key, revoked by deleting it.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import re
import secrets
from dataclasses import dataclass

TOKEN_PREFIX = "dpa"
TOKEN_RE = re.compile(r"^dpa_([0-9a-f]{16})_([A-Za-z0-9_-]{43})$")
KEY_ID_RE = re.compile(r"^[0-9a-f]{16}$")
SIGNATURE_RE = re.compile(r"^[0-9a-f]{64}$")
AGENT_KEY_ENV = "DYNAPLANE_AGENT_KEY"  # how an agent hands its key (AgentKey.encode) to its rank processes
_KEY_CONTEXT = b"dynaplane agent key\x00"  # the key is not the token: a database holding keys holds no tokens


class SealError(ValueError):
    """A token or seal that is malformed (says which rule it breaks)."""


@dataclass(frozen=True, slots=True)
class AgentKey:
    """What seals one agent's messages: the key's id (public, in every seal) and the secret."""

    key_id: str
    secret: bytes = b""

    def __repr__(self) -> str:  # never in a log
        return f"AgentKey({self.key_id!r})"

    def encode(self) -> str:
        """`<key id>:<hex secret>`: how an agent hands its key to its rank processes (environment)."""
        return f"{self.key_id}:{self.secret.hex()}"

    @classmethod
    def decode(cls, text: str) -> "AgentKey":
        key_id, _, secret = text.partition(":")
        if not KEY_ID_RE.match(key_id) or len(secret) != 64:
            raise SealError("an agent key is '<16 hex digits>:<64 hex digits>'")
        try:
            return cls(key_id, bytes.fromhex(secret))
        except ValueError:
            raise SealError("an agent key is '<16 hex digits>:<64 hex digits>'") from None


def token_new() -> str:
    """A fresh token: `dpa_` + a 16-hex-digit key id + `_` + 256 random bits (urlsafe base64)."""
    return f"{TOKEN_PREFIX}_{secrets.token_hex(8)}_{secrets.token_urlsafe(32)}"


def key_of_token(token: str) -> AgentKey:
    """The key a token gives (its id and the secret derived from the whole token)."""
    match = TOKEN_RE.match(token.strip())
    if match is None:
        raise SealError("an agent token is 'dpa_' + 16 hex digits + '_' + 43 url-safe characters, "
                        "as `dynaplane tokens issue` printed it")
    return AgentKey(match.group(1), hashlib.sha256(_KEY_CONTEXT + token.strip().encode()).digest())


def _canonical(node: str, task: str, body: object) -> bytes:
    """One byte string for (node, task, body) on both sides: what JSON carries survives a
    round trip through the broker unchanged (floats included), so sorted compact JSON is stable."""
    return json.dumps([node, task, body], sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode()


def signature(secret: bytes, node: str, task: str, body: object) -> str:
    return hmac.new(secret, _canonical(node, task, body), hashlib.sha256).hexdigest()


def seal(key: AgentKey | None, node: str, task: str, body: object) -> dict | None:
    """The seal to send next to `body` (a JSON-able dict) as the task's `seal` argument (None
    without a key: the receiver refuses the message and says so)."""
    if key is None:
        return None
    return {"node": node, "key": key.key_id, "sig": signature(key.secret, node, task, body)}


@dataclass(frozen=True, slots=True)
class Seal:
    node: str
    key_id: str
    sig: str


def seal_read(value: object) -> Seal:
    """A received seal's fields, checked for form only (the signature is checked against a key)."""
    if value is None:
        raise SealError("no seal: the message is not from an enrolled agent")
    if not isinstance(value, dict) or set(value) != {"node", "key", "sig"}:
        raise SealError("a seal is an object with exactly 'node', 'key' and 'sig'")
    node, key_id, sig = value["node"], value["key"], value["sig"]
    if not (isinstance(node, str) and 0 < len(node) <= 63):
        raise SealError("seal.node is a node name of 1 to 63 characters")
    if not (isinstance(key_id, str) and KEY_ID_RE.match(key_id)):
        raise SealError("seal.key is 16 hex digits")
    if not (isinstance(sig, str) and SIGNATURE_RE.match(sig)):
        raise SealError("seal.sig is 64 hex digits (HMAC-SHA256)")
    return Seal(node, key_id, sig)


def seal_valid(secret: bytes, received: Seal, task: str, body: object) -> bool:
    """Whether `received` was made with `secret` for exactly this node, task and body."""
    try:
        expected = signature(secret, received.node, task, body)
    except (TypeError, ValueError):  # a body JSON cannot carry was never sealed
        return False
    return hmac.compare_digest(expected, received.sig)
