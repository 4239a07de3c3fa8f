"""What the agents report about a job's ranks (protocol.JobReport), applied to the job.

started: starting -> running.          step: metrics appended, a live metrics event.
stopped: -> stopped, GPUs released.   failed: -> failed, GPUs released, other nodes stopped.
Reports travel through a thread pool, so they may arrive out of order: a step before its
started moves the job to running as well; a stopped report from a running job (max_steps
reached) goes through stopping. Reports of unknown or finished jobs are logged and
ignored: a late step after a stop must neither fail nor bring the job back.
"""
from __future__ import annotations

import logging

from django.db import transaction

from agents import protocol
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.jobs.events import METRIC_NAMES, METRIC_UNITS, MetricsEvent, job_stream
from controlplane.jobs.lifecycle import LIVE_JOB_STATES, JobState, JobTrigger, job_next_state
from controlplane.jobs.models import Job
from controlplane.jobs.scheduling import job_finish, stop_on_commit
from controlplane.jobs.services import metrics_append, metrics_series_get, publish_job

log = logging.getLogger(__name__)


def job_record_report(*, report: protocol.JobReport) -> Job | None:
    """Apply one report; returns the job (None when unknown)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=report.job_id).first()
        if job is None:
            log.info("ignored %s report from %s: job %s does not exist", report.kind, report.node, report.job_id)
            return None
        if job.state not in LIVE_JOB_STATES:
            log.info("ignored %s report from %s: job %s is %s", report.kind, report.node, job.name, job.state)
            return job
        {"started": _started, "step": _step, "stopped": _stopped, "failed": _failed}[report.kind](job, report)
    return job


def _to_running(job: Job) -> None:
    if job.state == JobState.STARTING:
        job.state = job_next_state(JobState.STARTING, JobTrigger.STARTED)
        job.save(update_fields=["state", "updated_at"])
        publish_job(job, "upsert")


def _started(job: Job, report: protocol.JobReport) -> None:
    _to_running(job)


def _step(job: Job, report: protocol.JobReport) -> None:
    if report.step is None:
        log.warning("ignored step report from %s for job %s: no step number", report.node, job.name)
        return
    _to_running(job)
    values = {name: getattr(report, name) for name in METRIC_NAMES}
    for name, value in values.items():
        if value is not None:
            series = metrics_series_get(job=job, name=name, unit=METRIC_UNITS[name])
            metrics_append(series_id=series.pk, xs=[float(report.step)], ys=[float(value)])
    stream = job_stream(job.pk)
    publish_on_commit(stream, MetricsEvent(seq=next_seq(stream), job=job.pk, step=report.step, **values))


def _stopped(job: Job, report: protocol.JobReport) -> None:
    state = JobState(job.state)
    if state is not JobState.STOPPING:  # max_steps reached, or the order raced the report
        state = job_next_state(state, JobTrigger.STOP)
    job_finish(job, state=job_next_state(state, JobTrigger.STOPPED))


def _failed(job: Job, report: protocol.JobReport) -> None:
    ranks = ", ".join(map(str, report.ranks)) or "unknown"
    error = f"node {report.node or '?'} ranks {ranks}: {report.error or 'failed without a reason'}"
    job_finish(job, state=job_next_state(JobState(job.state), JobTrigger.FAIL), error=error)
    stop_on_commit(job, [node for node in job.nodes if node != report.node])
