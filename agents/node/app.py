"""The agent's Celery app: consumes node.<name> and emulate; never imports Django."""
from __future__ import annotations

import logging

from celery import Celery, signals

from agents import protocol
from agents.node.config import AgentConfig
from agents.node.heartbeat import HeartbeatSender
from agents.node.inventory import discover

log = logging.getLogger(__name__)


def build_app(config: AgentConfig) -> tuple[Celery, HeartbeatSender]:
    """The app with the agent's tasks registered, and its (not yet started) heartbeats."""
    app = Celery(f"agent-{config.name}", broker=config.broker_url, set_as_current=True)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_default_queue=config.queue,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=True,
        worker_prefetch_multiplier=1,
    )
    gpus = discover(config.device, config.gpus, config.virtual_gpu_memory_bytes)
    heartbeats = HeartbeatSender(app, config, gpus)

    @app.task(name=protocol.NODE_PING)
    def ping() -> dict:
        """Answer with the node's current report (used to check a node end to end)."""
        from agents.node.heartbeat import build_heartbeat

        return build_heartbeat(config, gpus).model_dump(mode="json")

    @signals.worker_ready.connect(weak=False)
    def _start_heartbeats(sender=None, **_: object) -> None:
        log.info("agent %s ready on %s with %d %s device(s)", config.name, config.queue, len(gpus), config.device)
        heartbeats.start()

    @signals.worker_shutting_down.connect(weak=False)
    def _stop_heartbeats(**_: object) -> None:
        heartbeats.stop()

    return app, heartbeats


def run(config: AgentConfig, concurrency: int = 2, loglevel: str = "INFO") -> None:
    """Run the agent until it is told to stop (SIGTERM or Ctrl-C)."""
    app, _ = build_app(config)
    app.worker_main(
        [
            "worker",
            "--queues", f"{config.queue},{protocol.EMULATE_QUEUE}",
            "--hostname", f"agent@{config.name}",
            "--pool", "threads",
            "--concurrency", str(concurrency),
            "--loglevel", loglevel,
            "--without-mingle",
            "--without-gossip",
        ]
    )
