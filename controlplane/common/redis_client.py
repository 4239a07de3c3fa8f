"""One Redis client per process for the control plane's own keys (heartbeat liveness: the
broker's server). redis-py's client is thread-safe over its connection pool."""
from __future__ import annotations

import functools

import redis
from django.conf import settings


@functools.cache
def control_redis() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, socket_timeout=5, socket_connect_timeout=2,
                                health_check_interval=30)
