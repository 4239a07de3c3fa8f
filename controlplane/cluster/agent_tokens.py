"""Issuing and revoking agent tokens (issue 44). A token is shown once, when issued; only the key
derived from it is stored (agents/seal.py)."""
from __future__ import annotations

import hmac

from django.db import transaction
from django.utils import timezone

from agents import protocol
from agents.seal import AgentKey, key_of_token, token_new
from controlplane.cluster.models import AgentToken, Node


class TokenError(ValueError):
    """A request about tokens that cannot be met (names the field and the rule)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def token_issue(*, node: str, created_by: str = "", note: str = "") -> tuple[AgentToken, str]:
    """A new token for `node` (its other tokens stay valid until revoked): (row, the token)."""
    try:
        protocol.validate_node_name(node)
    except ValueError as exc:
        raise TokenError("node", str(exc)) from None
    if len(note) > 200:
        raise TokenError("note", "at most 200 characters")
    token = token_new()
    while key_of_token(token).key_id == "0" * 16:  # (the control plane's own key id: agent_auth.py)
        token = token_new()
    key = key_of_token(token)
    row = AgentToken.objects.create(key_id=key.key_id, node=node, secret=key.secret.hex(), note=note,
                                    created_by=created_by[:150])
    return row, token


def token_revoke(*, key_id: str) -> AgentToken:
    """Revoke one token: the agent's messages are refused once the workers' key caches
    expire (agent_auth.KEY_CACHE_SECONDS); its orders are no longer sealed for it."""
    with transaction.atomic():
        row = AgentToken.objects.select_for_update().filter(key_id=key_id).first()
        if row is None:
            raise TokenError("key_id", f"no token has key id {key_id!r}")
        if row.revoked_at is None:
            row.revoked_at = timezone.now()
            row.save(update_fields=["revoked_at"])
    return row


def node_order_key(node: str) -> AgentKey | None:
    """The key `node`'s orders are sealed with: the one its agent's heartbeats were last sealed
    with, while unrevoked; else its newest unrevoked token's (None: no current key)."""
    tokens = AgentToken.objects.filter(node=node, revoked_at=None)
    heard = Node.objects.filter(name=node).values_list("key_id", flat=True).first()
    row = (heard and tokens.filter(key_id=heard).first()) or tokens.order_by("-created_at", "-pk").first()
    return None if row is None else AgentKey(row.key_id, bytes.fromhex(row.secret))


def token_joined(token: str) -> AgentToken:
    """The unrevoked token row of `token` (an agent joining with it); its join is noted."""
    try:
        key = key_of_token(token)
    except ValueError as exc:
        raise TokenError("token", str(exc)) from None
    row = AgentToken.objects.filter(key_id=key.key_id).first()
    if row is None or not hmac.compare_digest(row.secret, key.secret.hex()):
        raise TokenError("token", "not a token this control plane issued")
    if row.revoked_at is not None:
        raise TokenError("token", f"revoked at {row.revoked_at.isoformat()}")
    AgentToken.objects.filter(pk=row.pk).update(last_joined_at=timezone.now())
    return row


def tokens_listed(limit: int = 1000) -> list[AgentToken]:
    """The tokens, newest first per node, each with `in_use`: its node's agent speaks with it now."""
    tokens = list(AgentToken.objects.all()[:limit])
    heard = dict(Node.objects.exclude(key_id="").values_list("key_id", "name"))
    for token in tokens:
        token.in_use = heard.get(token.key_id) == token.node
    return tokens
