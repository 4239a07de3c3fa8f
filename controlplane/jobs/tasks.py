"""Control-queue tasks fed by the agents, rank 0 of each job and beat. Thin: validate, call a service."""
from __future__ import annotations

import logging
from datetime import timedelta

from celery import shared_task
from django.conf import settings
from django.utils import timezone
from pydantic import ValidationError
from redis import RedisError

from agents import protocol
from controlplane.cluster.agent_auth import Refused, refused, speaker
from controlplane.cluster.shared_hearing import SharedHearing
from controlplane.common.combining import Combiner
from controlplane.common.errors import DATABASE_DOWN
from controlplane.jobs import (elastic_apply, elastic_trigger, ingest, job_logs, node_loss, preflight, reconcile, reports,
                               restore, timeouts)
from controlplane.jobs.job_speakers import job_message_heard

log = logging.getLogger(__name__)

# Reports and recoveries wait out a database restart (issue 43): tried again after 1, 2, 4, then
# every 5 s, as long as it takes; nothing a rank said is dropped for it.
WHILE_DATABASE_DOWN = dict(autoretry_for=DATABASE_DOWN, retry_backoff=1, retry_backoff_max=5, retry_jitter=False,
                           max_retries=None)

# Since when the control plane has heard without a break: the sweep's own arrivals, at whichever
# worker process (cluster/shared_hearing.py).
HEARING = SharedHearing(gap=timedelta(seconds=max(3.0, 3 * settings.CELERY_BEAT_SCHEDULE["sweep-lost-nodes"]["schedule"])))


def _validated(validate, message, what: str):
    """The message as its schema reads it, or None after logging why it was rejected (an
    agent's bad message must not fail the task, nor the worker)."""
    try:
        return validate(message)
    except ValidationError as exc:
        fields = message if isinstance(message, dict) else {}
        log.error("rejected %s of job %r from %r: %s", what, fields.get("job_id"), fields.get("node"), exc)
        return None


# Every task an agent or a rank 0 sends takes its `seal` (agents/seal.py): heard only from a node
# that serves the job it names (jobs/job_speakers.py); anything else is refused and logged.


@shared_task(name=protocol.CONTROL_JOB_REPORT, **WHILE_DATABASE_DOWN)
def job_report(report: dict, seal: dict | None = None) -> None:
    if not job_message_heard(protocol.CONTROL_JOB_REPORT, report, seal):
        return
    parsed = _validated(protocol.JOB_REPORTS.validate_python, report, "job report")
    if parsed is not None:
        reports.job_record_report(report=parsed)


@shared_task(name=protocol.CONTROL_TRANSITION_REPORT, **WHILE_DATABASE_DOWN)
def transition_report(report: dict, seal: dict | None = None) -> None:
    if not job_message_heard(protocol.CONTROL_TRANSITION_REPORT, report, seal):
        return
    parsed = _validated(protocol.TransitionReport.model_validate, report, "transition report")
    if parsed is not None:
        reports.transition_record_report(report=parsed)


@shared_task(name=protocol.CONTROL_JOB_LOG)
def job_log(report: dict, seal: dict | None = None) -> None:
    if not job_message_heard(protocol.CONTROL_JOB_LOG, report, seal):
        return
    parsed = _validated(protocol.JobLogTail.model_validate, report, "log tail")
    if parsed is not None:
        job_logs.job_log_record(report=parsed)


@shared_task(name=protocol.CONTROL_PREFLIGHT_REPORT, **WHILE_DATABASE_DOWN)
def preflight_report(report: dict, seal: dict | None = None) -> None:
    if not job_message_heard(protocol.CONTROL_PREFLIGHT_REPORT, report, seal):
        return
    parsed = _validated(protocol.PreflightReport.model_validate, report, "pre-flight report")
    if parsed is not None:
        preflight.preflight_record(parsed)


@shared_task(name=protocol.CONTROL_SWEEP_PREFLIGHTS)
def sweep_preflights() -> list[int]:
    """Beat: fail the pre-flights a node has not answered in time (preflight.py)."""
    return preflight.preflights_time_out()


@shared_task(name=protocol.CONTROL_JOB_RESTORE, **WHILE_DATABASE_DOWN)
def job_restore(job_id: int, early: bool = False, seal: dict | None = None) -> None:
    """Queued by restore.restore_begin: recover a restoring job (on its survivors, from its
    checkpoint, or fail it); `early`: a first look that acts only on the survivors. Only the
    control plane's own seal is heard (restore.restore_order)."""
    try:
        if not speaker(protocol.CONTROL_JOB_RESTORE, restore.restore_order(job_id, early), seal).is_control_plane:
            raise Refused("only the control plane queues restores")
    except Refused as exc:
        refused(protocol.CONTROL_JOB_RESTORE, seal, str(exc))
        return
    restore.job_restore(job_id=int(job_id), early=bool(early))


@shared_task(name=protocol.CONTROL_SWEEP_LOST_NODES)
def sweep_lost_nodes() -> list[str]:
    """Beat: mark silent nodes lost and act on the jobs that ran there (node_loss.py); and
    nudge the elastic scheduler when a node joined since it last looked."""
    now = timezone.now()
    try:
        lost = node_loss.nodes_lost_sweep(silent_for=timedelta(seconds=settings.DYNAPLANE_NODE_LOST_AFTER_SECONDS),
                                          now=now, heard_since=HEARING.sweep_arrived(now))
        elastic_trigger.nudge_for_joined_nodes()
    except (*DATABASE_DOWN, RedisError):  # nor could the heartbeats be recorded or read: the run of hearing
        HEARING.interrupt()  # breaks (a sweep that fails anywhere: one just back from a gap looks at nothing else)
        raise
    return lost


@shared_task(name=protocol.CONTROL_SWEEP_ELASTIC)
def sweep_elastic(why: str = "beat") -> list[dict]:
    """Beat, and queued after changes (elastic_trigger.py): carry out the elastic
    scheduler's decisions (elastic_apply.py)."""
    return elastic_apply.elastic_sweep(why=str(why)[:200])


@shared_task(name=protocol.CONTROL_SWEEP_RECONCILE)
def sweep_reconcile() -> list:
    """Beat: settle the jobs that no agent runs any more (reconcile.py)."""
    return reconcile.reconcile_sweep()


@shared_task(name=protocol.CONTROL_SWEEP_STUCK_TRANSITIONS)
def sweep_stuck_transitions() -> list[int]:
    """Beat: end the resizes no report has moved for DYNAPLANE_TRANSITION_TIMEOUT_SECONDS."""
    return timeouts.transitions_time_out(timeout=timedelta(seconds=settings.DYNAPLANE_TRANSITION_TIMEOUT_SECONDS))


# A batch that came before its predecessor waits for it this many times this long (the
# worker's threads took them out of order), then is applied anyway (ingest.py).
ORDER_WAIT_RETRIES = 50
ORDER_WAIT_SECONDS = 0.1


# The batches this process's worker threads hold at the same time are applied together, in one
# transaction (ingest.batches_ingest): at 200 jobs most of a batch's cost was its own transaction's
# round trips and commit (docs/scaling.md).
INGESTS = Combiner(ingest.batches_ingest, lambda entry: ingest.batch_ingest(batch=entry[0], wait=entry[1]),
                   everyones=DATABASE_DOWN)


@shared_task(bind=True, name=protocol.CONTROL_INGEST_EVENTS, **WHILE_DATABASE_DOWN)
def ingest_events(self, batch: dict, early_tries: int = 0, seal: dict | None = None) -> str:
    """A batch of one job's reports from its rank 0 (protocol.ReportBatch). `early_tries`: how
    often it came before its predecessor (tries while the database was down do not count)."""
    if not job_message_heard(protocol.CONTROL_INGEST_EVENTS, batch, seal):
        return "refused"
    try:
        parsed = protocol.ReportBatch.model_validate(batch)
    except ValidationError as exc:
        log.error("rejected report batch of job %r from %r: %s", batch.get("job_id"), batch.get("node"), exc)
        return "rejected"
    outcome = INGESTS.submit((parsed, early_tries < ORDER_WAIT_RETRIES))
    if INGESTS.groups % 1000 == 0:  # (how well this process groups: docs/scaling.md)
        log.info("report batches applied: %d in %d groups", INGESTS.items, INGESTS.groups)
    if outcome is ingest.Outcome.EARLY:
        raise self.retry(kwargs={"batch": batch, "early_tries": early_tries + 1, "seal": seal},
                         countdown=ORDER_WAIT_SECONDS)
    return outcome.value
