"""How fast the control plane applies `step` JobReports (controlplane/jobs/reports.py
job_record_report), the path every live training metric takes to the dashboard, measured
without the stack around it: one thread, a fresh test database (DATABASE_URL: PostgreSQL
or SQLite), events published to the channel layer on commit (REDIS_URL).

Figures, from the same process:
- one report per transaction (control.job_report: what an agent's own reports take);
- the same reports, `--batch` of them in one transaction (commits saved, nothing else);
- batched ingestion (control.ingest_events: ingest.batch_ingest of ReportBatches of
  `--batch` reports, what rank 0 sends), per report;
- a steady heartbeat of an 8-GPU node (the other task the control worker runs most);
- a bare `UPDATE ... ; COMMIT` round trip on the same database (the commit's floor).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test REDIS_URL=redis://127.0.0.1:6379/5 \\
        .venv/bin/python -m benchmarks.step_reports --reports 200 --batch 10
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from datetime import datetime, timezone


def _percentiles(seconds: list[float]) -> str:
    ordered = sorted(seconds)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return f"p50 {statistics.median(ordered) * 1e3:.1f} ms, p95 {p95 * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reports", type=int, default=200)
    parser.add_argument("--batch", type=int, default=10)
    args = parser.parse_args()
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "controlplane.settings")
    import django

    django.setup()
    from django.db import connection, transaction
    from django.test.utils import CaptureQueriesContext, setup_databases, setup_test_environment, teardown_databases

    from agents import protocol
    from agents.node.inventory import virtual_gpus
    from controlplane.cluster.services import node_record_heartbeat
    from controlplane.jobs.ingest import batch_ingest
    from controlplane.jobs.models import Job
    from controlplane.jobs.reports import job_record_report

    setup_test_environment()
    databases = setup_databases(verbosity=0, interactive=False)
    try:
        def report(job: Job, step: int) -> protocol.JobReport:
            return protocol.JobReport(job_id=job.pk, node="node-1", kind="step", step=step, loss=2.0,
                                      step_seconds=0.1, tokens_per_second=1e4, sent_at=datetime.now(timezone.utc))

        single = Job.objects.create(name="single", model="tiny-gpt", layout="dp=2", world_size=2, state="running")
        per_report = []
        for step in range(1, args.reports + 1):
            with CaptureQueriesContext(connection) as queries:
                started = time.perf_counter()
                job_record_report(report=report(single, step))
                per_report.append(time.perf_counter() - started)
        batched_job = Job.objects.create(name="batched", model="tiny-gpt", layout="dp=2", world_size=2,
                                         state="running")
        per_batch = []
        for first in range(1, args.reports + 1, args.batch):
            started = time.perf_counter()
            with transaction.atomic():
                for step in range(first, min(first + args.batch, args.reports + 1)):
                    job_record_report(report=report(batched_job, step))
            per_batch.append(time.perf_counter() - started)
        ingested_job = Job.objects.create(name="ingested", model="tiny-gpt", layout="dp=2", world_size=2,
                                          state="running")
        per_ingest = []
        for n, first in enumerate(range(1, args.reports + 1, args.batch)):
            batch = protocol.ReportBatch(job_id=ingested_job.pk, node="node-1", stream="bench", batch=n + 1,
                                         reports=tuple(report(ingested_job, step) for step in
                                                       range(first, min(first + args.batch, args.reports + 1))))
            started = time.perf_counter()
            batch_ingest(batch=batch)
            per_ingest.append((time.perf_counter() - started) / len(batch.reports))
        beats = []
        for n in range(args.reports):
            now = datetime.now(timezone.utc)
            beat = protocol.AgentHeartbeat(node="node-1", host="h", device="cpu", pid=1, started_at=now, sent_at=now,
                                           interval_seconds=2.0, gpus=virtual_gpus(8, memory_bytes=80 * 2**30))
            started = time.perf_counter()
            node_record_heartbeat(report=beat)
            if n:  # the first one creates the node
                beats.append(time.perf_counter() - started)
        commits = []
        with connection.cursor() as cursor:
            for _ in range(args.reports):
                started = time.perf_counter()
                with transaction.atomic():
                    cursor.execute("UPDATE jobs_job SET step = step WHERE id = %s", [single.pk])
                commits.append(time.perf_counter() - started)
        per_batched_report = [s / args.batch for s in per_batch]
        print(f"database: {connection.vendor}; {args.reports} step reports; load average "
              f"{os.getloadavg()[0]:.1f}")
        print(f"one report per transaction: {_percentiles(per_report)} per report, "
              f"{len(queries.captured_queries)} statements each -> {1 / statistics.median(per_report):.0f} reports/s")
        print(f"{args.batch} reports per transaction: {_percentiles(per_batched_report)} per report -> "
              f"{1 / statistics.median(per_batched_report):.0f} reports/s")
        print(f"batched ingestion, {args.batch} reports per ReportBatch: {_percentiles(per_ingest)} per report -> "
              f"{1 / statistics.median(per_ingest):.0f} reports/s")
        print(f"steady heartbeat of an 8-GPU node: {_percentiles(beats)}")
        print(f"bare UPDATE + COMMIT: {_percentiles(commits)}")
    finally:
        teardown_databases(databases, verbosity=0)


if __name__ == "__main__":
    main()
