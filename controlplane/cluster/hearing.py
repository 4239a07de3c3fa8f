"""Whether the control plane could hear its nodes: a node's silence means it is lost only while
the broker delivered (issue 43). The lost-node sweep itself comes through the broker every
DYNAPLANE_SWEEP_SECONDS (Celery beat -> broker -> worker), so a gap in its arrivals is a time the
control plane could not hear anyone (a broker outage, or no worker running); heartbeats missed then
say nothing about the nodes. `Hearing.since` is the start of the current unbroken run of sweeps:
a node is lost when it has been silent for the configured time *within* that run.

Kept per worker process (a restarted or added worker starts a fresh run: it waits one silence
period before it marks a node lost, which delays a detection and never invents one)."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta


class Hearing:
    def __init__(self, gap: timedelta) -> None:
        self.gap = gap  # a longer pause between sweeps breaks the run
        self.since: datetime | None = None
        self._last: datetime | None = None
        self._lock = threading.Lock()

    def sweep_arrived(self, now: datetime) -> datetime:
        """Note a sweep's arrival; returns since when the control plane has heard without a break."""
        with self._lock:
            if self._last is None or now - self._last > self.gap or now < self._last:
                self.since = now
            self._last = max(now, self._last or now)
            return self.since

    def interrupt(self) -> None:
        """A sweep that could not look (the database down): the next one starts a new run."""
        with self._lock:
            self._last = None

    def heard_for(self, now: datetime) -> timedelta:
        return now - self.since if self.since is not None else timedelta(0)
