"""Control-queue tasks fed by the agents' heartbeats. Thin: validate, call a service. (The
beat's lost-node sweep is in jobs/tasks.py: it acts on the jobs too.)"""
from __future__ import annotations

import logging

from celery import shared_task
from pydantic import ValidationError

from agents import protocol
from controlplane.cluster import heartbeat_intake, services
from controlplane.cluster.agent_auth import heard_from

log = logging.getLogger(__name__)


@shared_task(name=protocol.CONTROL_TAKE_HEARTBEATS)
def take_heartbeats() -> dict:
    """Beat, every second: the heartbeats agents posted to Redis since the last one
    (heartbeat_intake.py); returns what it did with them."""
    intake = heartbeat_intake.heartbeats_take()
    if intake.recorded or intake.dropped:
        log.debug("heartbeats: %s", intake)
    return {"taken": intake.taken, "recorded": intake.recorded, "steady": intake.steady,
            "dropped": intake.dropped, "seconds": round(intake.seconds, 4)}


@shared_task(name=protocol.CONTROL_AGENT_HEARTBEAT)
def agent_heartbeat(report: dict, seal: dict | None = None) -> None:
    """A heartbeat sent as a task, as agents before issue 47 did (they now post to Redis:
    agents/liveness.py): recorded at once. `seal`: the agent's (agents/seal.py); a heartbeat is
    heard only from the node it names."""
    who = heard_from(protocol.CONTROL_AGENT_HEARTBEAT, report, seal)
    if who is None:
        return
    try:
        heartbeat = protocol.AgentHeartbeat.model_validate(report)
    except ValidationError as exc:
        log.error("rejected heartbeat %r: %s", report.get("node"), exc)
        return
    services.node_record_heartbeat(report=heartbeat, key_id="" if who.is_control_plane else who.key_id)
