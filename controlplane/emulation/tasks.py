"""Control-queue task fed by the agents that run emulations. Thin: validate, call a service."""
from __future__ import annotations

import logging

from celery import shared_task
from pydantic import ValidationError

from agents import protocol
from controlplane.cluster.agent_auth import heard_from
from controlplane.emulation import services

log = logging.getLogger(__name__)


@shared_task(name=protocol.CONTROL_SWEEP_EMULATIONS)
def sweep_emulations() -> list[int]:
    """Beat: fail the running emulation runs no agent works on any more."""
    return services.emulations_reconcile()


@shared_task(name=protocol.CONTROL_EMULATION_PROGRESS)
def emulation_progress(report: dict, seal: dict | None = None) -> None:
    """`seal`: the agent's (agents/seal.py), whose name the report gives as `agent`."""
    if heard_from(protocol.CONTROL_EMULATION_PROGRESS, report, seal, node_field="agent") is None:
        return
    try:
        progress = protocol.EmulationProgress.model_validate(report)
    except ValidationError as exc:
        log.error("rejected emulation progress %r: %s", report.get("run_id"), exc)
        return
    services.emulation_record_progress(progress=progress)
