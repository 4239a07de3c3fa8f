"""Batches of one job's reports from its rank 0 (protocol.ReportBatch, task
control.ingest_events), applied in one transaction.

Why batches: the control worker's cost is per task (job row lock, commit, channel-layer
send, Celery and pydantic overhead), and its threads share one GIL, so one task per step
report capped it far below what 10 jobs x 10 steps/s offer (docs/benchmarks.md). A batch
takes the job lock once, appends all its steps' metrics in one go, allocates their seqs
in one statement and sends their events as one channel-layer message.

Order: the worker's threads may pick batch n+1 up before batch n. The job row remembers
the last batch applied of its reporter's stream (Job.report_stream, report_batch), so
  - the next batch (or a new stream's first) is applied;
  - a repeat (a redelivered task) is ignored;
  - a batch that comes too early is not applied (EARLY: the task tries again shortly),
    unless `wait` is false (the task has waited long enough: the missing batches are
    taken as lost, logged, and this one is applied), or unless the batch says its sender
    dropped the missing ones (ReportBatch.dropped: its outbox's bound, in a broker outage).
Within a batch, reports are applied in the order rank 0 made them, with the same rules
as one report (reports.py).
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Iterator
from itertools import groupby

from django.db import transaction

from agents import protocol
from controlplane.jobs import reports
from controlplane.jobs.models import Job

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    APPLIED = "applied"
    EARLY = "early"  # a batch before it is still to come: try again
    REPEAT = "repeat"  # applied before: ignored
    UNKNOWN_JOB = "unknown job"


def batch_ingest(*, batch: protocol.ReportBatch, wait: bool = True) -> Outcome:
    """Apply one batch if it is the job's next (see the module docstring)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=batch.job_id).first()
        if job is None:
            log.info("ignored report batch %s/%s from %s: job %s does not exist", batch.stream, batch.batch,
                     batch.node, batch.job_id)
            return Outcome.UNKNOWN_JOB
        outcome = _place(job, batch, wait)
        if outcome is not Outcome.APPLIED:
            return outcome
        job.report_stream, job.report_batch = batch.stream, batch.batch + batch.covers - 1
        for run in _runs(batch.reports):
            if run[0].kind != "step" and reports.recovery_report(job, run[0]):
                continue
            why = {id(report): reports.refusal(job, report) for report in run}
            for refused in {w for w in why.values() if w}:  # one line per reason, not per step
                log.info("ignored %d %s report(s) of batch %s/%s from %s: %s",
                         sum(w == refused for w in why.values()), run[0].kind, batch.stream, batch.batch, batch.node,
                         refused)
            kept = [report for report in run if not why[id(report)]]
            if run[0].kind == "step":
                reports.steps(job, kept)
            elif kept:
                reports.HANDLERS[run[0].kind](job, kept[0])
        job.save(update_fields=["report_stream", "report_batch", "step"])  # (one statement for the batch)
    return Outcome.APPLIED


def _place(job: Job, batch: protocol.ReportBatch, wait: bool) -> Outcome:
    """Where the batch stands in its stream's order."""
    expected = job.report_batch + 1 if batch.stream == job.report_stream else 1
    if batch.batch < expected <= batch.batch + batch.covers - 1:  # never sent so: merged only before a first try
        log.warning("ignored report batches %s/%s-%s from %s for job %s: they overlap the ones applied (up to %s)",
                    batch.stream, batch.batch, batch.batch + batch.covers - 1, batch.node, job.name, job.report_batch)
        return Outcome.REPEAT
    if batch.batch < expected:
        log.info("ignored report batch %s/%s from %s for job %s: already applied (up to %s)", batch.stream,
                 batch.batch, batch.node, job.name, job.report_batch)
        return Outcome.REPEAT
    if batch.batch > expected:
        if batch.dropped is not None and batch.dropped[0] <= expected and batch.dropped[1] == batch.batch - 1:
            log.warning("job %s: report batches %s-%s of %s from %s were dropped by rank 0 (its buffer's bound, "
                        "in a broker outage): steps missing from the record", job.name, expected,
                        batch.batch - 1, batch.stream, batch.node)
            return Outcome.APPLIED
        if wait:
            return Outcome.EARLY
        log.warning("job %s: report batch %s/%s from %s applied without batches %s-%s (lost or too late)",
                    job.name, batch.stream, batch.batch, batch.node, expected, batch.batch - 1)
    return Outcome.APPLIED


def _runs(items: tuple[protocol.JobReport, ...]) -> Iterator[list[protocol.JobReport]]:
    """Consecutive step reports together, every other report alone, in order."""
    for is_step, group in groupby(items, key=lambda report: report.kind == "step"):
        if is_step:
            yield list(group)
        else:
            yield from ([report] for report in group)
