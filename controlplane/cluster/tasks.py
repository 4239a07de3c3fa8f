"""Control-queue tasks fed by the agents and by beat. Thin: validate, call a service."""
from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from pydantic import ValidationError

from agents import protocol
from controlplane.cluster import services

log = logging.getLogger(__name__)


@shared_task(name=protocol.CONTROL_AGENT_HEARTBEAT)
def agent_heartbeat(report: dict) -> None:
    try:
        heartbeat = protocol.AgentHeartbeat.model_validate(report)
    except ValidationError as exc:
        log.error("rejected heartbeat %r: %s", report.get("node"), exc)
        return
    services.node_record_heartbeat(report=heartbeat)


@shared_task(name=protocol.CONTROL_SWEEP_LOST_NODES)
def sweep_lost_nodes() -> list[str]:
    return services.nodes_mark_lost(silent_for=timedelta(seconds=settings.DYNAPLANE_NODE_LOST_AFTER_SECONDS))
