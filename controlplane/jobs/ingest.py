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
from collections import defaultdict
from collections.abc import Iterator, Sequence
from itertools import groupby

from django.db import connection, transaction

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
            _unknown(batch)
            return Outcome.UNKNOWN_JOB
        return _apply(job, batch, wait)


def batches_ingest(entries: Sequence[tuple[protocol.ReportBatch, bool]]) -> list[Outcome]:
    """Several batches, of one job or many (what a worker's threads took at the same time:
    controlplane/common/combining.py), each with its `wait`, in one transaction: the jobs
    locked in id order in one query; a job's batches applied in their streams' order (so
    batch n+1 taken beside batch n is not early); the common case, batches of step reports
    only, with one metrics append, one seq allocation and one job update for all jobs
    together; a job with any other report applied batch by batch as batch_ingest does.
    Outcomes in the entries' order, each what batch_ingest would have said."""
    outcomes: list[Outcome] = [Outcome.UNKNOWN_JOB] * len(entries)
    with transaction.atomic():
        jobs = {job.pk: job for job in Job.objects.select_for_update().filter(
            pk__in=sorted({batch.job_id for batch, _ in entries})).order_by("pk")}
        by_job: dict[int, list[int]] = defaultdict(list)
        for i, (batch, _) in enumerate(entries):
            if batch.job_id in jobs:
                by_job[batch.job_id].append(i)
            else:
                _unknown(batch)
        stepped: list[tuple[Job, list[protocol.JobStepped]]] = []
        moved: list[Job] = []
        for job_id in sorted(by_job):
            job = jobs[job_id]
            streams = list(dict.fromkeys(entries[i][0].stream for i in by_job[job_id]))
            order = sorted(by_job[job_id], key=lambda i: (streams.index(entries[i][0].stream), entries[i][0].batch))
            if not all(report.kind == "step" for i in order for report in entries[i][0].reports):
                for i in order:
                    outcomes[i] = _apply(job, *entries[i])
                continue
            kept: list[protocol.JobStepped] = []
            for i in order:
                batch, wait = entries[i]
                outcomes[i] = _place(job, batch, wait)
                if outcomes[i] is Outcome.APPLIED:
                    job.report_stream, job.report_batch = batch.stream, batch.batch + batch.covers - 1
                    kept += _kept(job, batch, list(batch.reports))
            if any(outcomes[i] is Outcome.APPLIED for i in order):
                moved.append(job)
                stepped.append((job, kept))
        reports.steps_of_jobs(stepped)
        if moved:
            table = connection.ops.quote_name(Job._meta.db_table)
            with connection.cursor() as cursor:
                cursor.executemany(f"UPDATE {table} SET report_stream = %s, report_batch = %s, step = %s WHERE id = %s",
                                   [(job.report_stream, job.report_batch, job.step, job.pk) for job in moved])
    return outcomes


def _unknown(batch: protocol.ReportBatch) -> None:
    log.info("ignored report batch %s/%s from %s: job %s does not exist", batch.stream, batch.batch,
             batch.node, batch.job_id)


def _apply(job: Job, batch: protocol.ReportBatch, wait: bool) -> Outcome:
    """Apply one batch to its locked job if it is the job's next."""
    outcome = _place(job, batch, wait)
    if outcome is not Outcome.APPLIED:
        return outcome
    job.report_stream, job.report_batch = batch.stream, batch.batch + batch.covers - 1
    for run in _runs(batch.reports):
        if run[0].kind != "step" and reports.recovery_report(job, run[0]):
            continue
        kept = _kept(job, batch, run)
        if run[0].kind == "step":
            reports.steps(job, kept)
        elif kept:
            reports.HANDLERS[run[0].kind](job, kept[0])
    job.save(update_fields=["report_stream", "report_batch", "step"])  # (one statement for the batch)
    return Outcome.APPLIED


def _kept(job: Job, batch: protocol.ReportBatch, run: list[protocol.JobReport]) -> list[protocol.JobReport]:
    """The reports of a run the (locked) job takes; the refused ones logged, one line per reason."""
    why = {id(report): reports.refusal(job, report) for report in run}
    for refused in {w for w in why.values() if w}:  # one line per reason, not per step
        log.info("ignored %d %s report(s) of batch %s/%s from %s: %s",
                 sum(w == refused for w in why.values()), run[0].kind, batch.stream, batch.batch, batch.node,
                 refused)
    return [report for report in run if not why[id(report)]]


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
