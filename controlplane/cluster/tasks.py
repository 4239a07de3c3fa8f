"""Control-queue task fed by the agents' heartbeats. Thin: validate, call a service. (The
beat's lost-node sweep is in jobs/tasks.py: it acts on the jobs too.)"""
from __future__ import annotations

import logging

from celery import shared_task
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
