"""The heartbeat loop: every interval, post the node's inventory to the control plane's inbox
in Redis (agents/liveness.py)."""
from __future__ import annotations

import logging
import threading
from datetime import datetime, timezone

import redis

from agents import protocol
from agents.liveness import HeartbeatPoster
from agents.node.config import AgentConfig
from agents.node.host_stats import HostSampler
from agents.seal import seal

log = logging.getLogger(__name__)


def build_heartbeat(config: AgentConfig, gpus: tuple[protocol.GpuReport, ...], live=None,
                    host_stats: protocol.HostStats | None = None) -> protocol.AgentHeartbeat:
    """`live()`: (running jobs {job id: ranks}, emulation run ids) on this node."""
    jobs, emulations = live() if live is not None else ({}, ())
    return protocol.AgentHeartbeat(
        node=config.name,
        host=config.host,
        device=config.device,
        pid=config.pid,
        started_at=config.started_at,
        sent_at=datetime.now(timezone.utc),
        interval_seconds=config.heartbeat_seconds,
        gpus=gpus,
        jobs=tuple(protocol.RunningJob(job_id=job, ranks=tuple(ranks)) for job, ranks in sorted(jobs.items())),
        emulations=tuple(sorted(emulations)),
        host_stats=host_stats,
    )


class HeartbeatSender:
    """A daemon thread; stop() ends it. Broker outages are logged and retried next beat.

    Only a node's newest heartbeat is kept in the inbox and the control plane skips one posted
    more than three intervals before it looks, so a stale heartbeat can never mark a dead node
    alive again.
    """

    def __init__(self, config: AgentConfig, gpus: tuple[protocol.GpuReport, ...],
                 poster: HeartbeatPoster | None = None) -> None:
        self._poster = poster
        self._config = config
        self._gpus = gpus
        self.live = None  # () -> (jobs, emulations): what the node runs (set by the agent's app)
        self._host = HostSampler()  # (used by the heartbeat thread only: it keeps the last CPU counters)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{config.name}", daemon=True)
        self.sent = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def beat(self) -> None:
        report = build_heartbeat(self._config, self._gpus, self.live, self._host.sample()).model_dump(mode="json")
        if self._poster is None:
            self._poster = HeartbeatPoster(self._config.broker_url)
        self._poster.post(self._config.name, report,
                          seal(self._config.key, self._config.name, protocol.CONTROL_AGENT_HEARTBEAT, report))
        self.sent += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.beat()
            except (redis.RedisError, OSError) as exc:  # broker down or unreachable: try next beat
                log.warning("heartbeat from %s not sent: %s", self._config.name, exc)
            self._stop.wait(self._config.heartbeat_seconds)
