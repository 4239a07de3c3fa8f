"""Whether the control plane could hear its nodes: a node's silence means it is lost only while
the broker delivered (issue 43). The lost-node sweep itself comes through the broker every
DYNAPLANE_SWEEP_SECONDS (Celery beat -> broker -> worker), so a gap in its arrivals is a time the
control plane could not hear anyone (a broker outage, or no worker running); heartbeats missed then
say nothing about the nodes. The run of hearing starts at the first arrival after a gap: a node is
lost when it has been silent for the configured time *within* that run.

The run is shared by every worker process, kept in Redis and timed by Redis's clock. The sweep
goes to whichever process takes it; a run kept per process had a gap whenever another process took
a few sweeps in a row: with two worker processes a silent node was seen lost after 27 s instead of
7 s (benchmarks/cluster_scale.py), and in CI once not within a minute. Here every arrival, whoever
takes it, extends the one run, and a gap is a gap in all arrivals. The script reads Redis's clock,
so hosts' clocks are never compared: it answers how long the run has lasted, and the worker puts
that against its own `now`. A fresh Redis (restarted, flushed) holds no run: the next arrival
starts one, which delays a detection and never invents one."""
from __future__ import annotations

from datetime import datetime, timedelta

from redis.exceptions import RedisError

from controlplane.common.redis_client import control_redis

LAST = "dynaplane:hearing:last"  # the latest sweep's arrival (Redis's clock, seconds)
SINCE = "dynaplane:hearing:since"  # the start of the current run (Redis's clock, seconds)
KEEP_SECONDS = 86_400  # (keys of a control plane that went away do not stay forever)

# KEYS: LAST, SINCE. ARGV: the gap that breaks a run (s), the keys' lifetime (s). Returns how long
# the run has lasted, in seconds, as a string.
ARRIVED = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local last = tonumber(redis.call('GET', KEYS[1]))
local since = tonumber(redis.call('GET', KEYS[2]))
if last == nil or since == nil or now - last > tonumber(ARGV[1]) or now < last then
  since = now
end
if last == nil or now > last then
  last = now
end
redis.call('SET', KEYS[1], string.format('%.6f', last), 'EX', ARGV[2])
redis.call('SET', KEYS[2], string.format('%.6f', since), 'EX', ARGV[2])
return string.format('%.6f', now - since)
"""


class SharedHearing:
    """Hearing's interface (sweep_arrived, interrupt), its state in Redis."""

    def __init__(self, gap: timedelta, client=None) -> None:
        self.gap = gap
        self._client = client
        self._script = None

    def _redis(self):
        if self._client is None:
            self._client = control_redis()
        return self._client

    def sweep_arrived(self, now: datetime) -> datetime:
        """Note a sweep's arrival (any process's); since when, in `now`'s clock, the control plane
        has heard without a break. Raises RedisError when Redis does not answer (nor then does
        the broker: no sweep can count as heard)."""
        if self._script is None:
            self._script = self._redis().register_script(ARRIVED)
        lasted = float(self._script(keys=[LAST, SINCE], args=[self.gap.total_seconds(), KEEP_SECONDS]))
        return now - timedelta(seconds=lasted)

    def interrupt(self) -> None:
        """A sweep that could not look (the database down): the next arrival starts a new run, for
        every process. Redis down too: its keys say nothing newer than the outage's start, which
        the next arrival sees as a gap."""
        try:
            self._redis().delete(LAST)
        except RedisError:
            pass

    def forget(self) -> None:
        """No run at all (a fresh control plane; tests)."""
        self._redis().delete(LAST, SINCE)
