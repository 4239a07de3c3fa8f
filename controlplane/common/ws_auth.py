"""Websocket authentication by DRF token (`Authorization: Token <key>`), for programs;
browsers use their session (Channels' AuthMiddleware, which wraps this one)."""
from __future__ import annotations

from channels.db import database_sync_to_async
from channels.middleware import BaseMiddleware


@database_sync_to_async
def _user_for_token(key: str):
    from rest_framework.authtoken.models import Token

    token = Token.objects.select_related("user").filter(key=key).first()
    return token.user if token and token.user.is_active else None


class BrowserOriginValidator:
    """Channels' AllowedHostsOriginValidator for connections that send an Origin header:
    browsers always do, and a page of another site must not read the streams with its
    visitor's session. A connection without one is a program's (curl, websockets), which
    authenticates by token or reads what is open to all, as the HTTP API allows."""

    def __init__(self, app) -> None:
        from channels.security.websocket import AllowedHostsOriginValidator

        self.app, self.checked = app, AllowedHostsOriginValidator(app)

    async def __call__(self, scope, receive, send):
        if any(name.lower() == b"origin" for name, _ in scope.get("headers", [])):
            return await self.checked(scope, receive, send)
        return await self.app(scope, receive, send)


class TokenAuthMiddleware(BaseMiddleware):
    async def __call__(self, scope, receive, send):
        headers = dict(scope.get("headers", []))
        auth = headers.get(b"authorization", b"").decode("latin-1")
        scheme, _, key = auth.partition(" ")
        if scheme.lower() == "token" and key:
            user = await _user_for_token(key.strip())
            if user is not None:
                scope = dict(scope, user=user)
        return await super().__call__(scope, receive, send)
