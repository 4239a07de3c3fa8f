"""Writes rank 0's log tail of a job (protocol.JobLogTail, from its agent) and tells the
job's page: a newer tail replaces the stored one whole and goes out as a `log` event."""
from __future__ import annotations

import logging

from django.db import transaction

from agents.protocol import JobLogTail
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.jobs.events import LogEvent, job_stream
from controlplane.jobs.models import Job, JobLog
from controlplane.jobs.selectors import job_log_view

log = logging.getLogger(__name__)


def job_log_record(*, report: JobLogTail) -> bool:
    """Store the tail unless the job is gone or a tail read later is already stored (tails
    of one job may arrive out of order: each is whole, the latest read wins). True when
    stored; an unchanged tail is not written again nor sent."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=report.job_id).first()
        if job is None:
            log.info("log tail of job %d, which no longer exists: dropped", report.job_id)
            return False
        row = JobLog.objects.filter(job=job).first()
        if row is not None and row.sent_at > report.sent_at:
            return False
        fields = {"node": report.node, "rank": report.rank, "restore_id": report.restore_id,
                  "lines": list(report.lines), "truncated": report.truncated, "finished": report.finished}
        if row is not None and all(getattr(row, k) == v for k, v in fields.items()):
            return False
        JobLog.objects.update_or_create(job=job, defaults={**fields, "sent_at": report.sent_at})
        stream = job_stream(job.pk)
        publish_on_commit(stream, LogEvent(seq=next_seq(stream), log=job_log_view(job_id=job.pk)))
    return True
