"""Reads of exports: a row as the API and the job's stream show it, and a job's exports."""
from __future__ import annotations

from django.db.models import QuerySet

from controlplane.exports.models import Export
from controlplane.jobs.events import ExportView


def _iso(value) -> str | None:
    return value.isoformat() if value is not None else None


def export_view(row: Export) -> ExportView:
    return ExportView(id=row.pk, job=row.job_id, job_name=row.job_name, checkpoint_step=row.checkpoint_step,
                      state=row.state, path=row.path, files_written=row.files_written, files_total=row.files_total,
                      bytes=row.bytes, seconds=row.seconds, error=row.error, created_at=_iso(row.created_at),
                      started_at=_iso(row.started_at), finished_at=_iso(row.finished_at))


def export_list(*, job_id: int | None = None) -> QuerySet[Export]:
    """Exports, newest first; only the job's when `job_id` is given."""
    rows = Export.objects.order_by("-created_at", "-id")
    return rows if job_id is None else rows.filter(job_id=job_id)
