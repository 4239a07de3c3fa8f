"""Health: is the database reachable, the broker answering, and how many agents live.
"degraded" with 503 when the database or the broker does not answer (the control plane
cannot act); "degraded" with 200 when it works but a node is lost (`warnings` names it)."""
from __future__ import annotations

import redis
from django.conf import settings
from django.db import DatabaseError, connection
from drf_spectacular.utils import extend_schema
from rest_framework.permissions import AllowAny
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.cluster.selectors import inventory_counts, lost_nodes


def _redacted(url: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
        return urlunsplit(parts._replace(netloc=netloc))
    return url


class HealthView(APIView):
    permission_classes = [AllowAny]
    authentication_classes: list = []

    @extend_schema(responses={200: dict, 503: dict})
    def get(self, request):
        database = {"ok": True, "vendor": connection.vendor}
        try:
            with connection.cursor() as cursor:
                cursor.execute("SELECT 1")
        except DatabaseError as exc:
            database.update(ok=False, error=str(exc))
        broker = {"ok": True, "url": _redacted(settings.REDIS_URL)}
        try:
            client = redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=1, socket_timeout=1)
            client.ping()
            client.close()
        except (redis.RedisError, OSError) as exc:
            broker.update(ok=False, error=str(exc))
        working = database["ok"] and broker["ok"]
        warnings = [f"{name}: {what} unreachable" for name, what in (("database", database), ("broker", broker))
                    if not what["ok"]]
        body = {"database": database, "broker": broker}
        if database["ok"]:
            body.update(inventory_counts())
            warnings += [f"node {name} lost: no heartbeat since {seen.isoformat(timespec='seconds') if seen else 'never'}"
                         for name, seen in lost_nodes()]
        else:
            body.update(agents={"healthy": 0, "lost": 0}, gpus={"total": 0})
        body.update(status="degraded" if warnings else "ok", warnings=warnings)
        return Response(body, status=200 if working else 503)
