"""The `exports` queue's task (the control worker consumes it beside `control`). Thin: call the service."""
from __future__ import annotations

from celery import shared_task

from controlplane.exports import services


@shared_task(name=services.EXPORT_TASK)
def export_run(export_id: int) -> None:
    services.export_run(export_id=int(export_id))
