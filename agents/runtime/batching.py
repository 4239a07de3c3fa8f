"""Rank 0's job reports, batched: at most one control.ingest_events task per `window`
seconds of step reports instead of one task per step.

The control worker's cost is per task (a job row lock, a commit, a channel-layer send,
Celery's own work), so a job reporting 10 steps/s costs it 10 tasks/s unbatched and 2
batched at a 0.5 s window (docs/benchmarks.md: the window that kept 10 jobs x 10 steps/s
under 1 s on the loaded CI machine). Like Nagle's algorithm, a step that finds nothing
sent for `window` s leaves at once (a job reporting slowly pays no latency); later ones
wait until `window` s after the last batch and leave together. A report that is not a
step (started, checkpoint, stopped, ...) is rare and often ends the process, so it goes
out at once, together with the steps before it (order kept). `flush()` sends what is
waiting (before a transition report, so the dashboard sees the steps before the switch
first) and `close()` flushes and stops the timer.

Batches are numbered 1, 2, ... within a stream (a random name per batcher): the control
plane applies them in that order although the worker's threads may pick them up out of
order (controlplane/jobs/ingest.py).
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

from agents import protocol

DEFAULT_WINDOW_SECONDS = 0.5


class ReportBatcher:
    """Collects one job's JobReports and hands them to `send` as ReportBatches."""

    def __init__(self, send: Callable[[protocol.ReportBatch], None], *, job_id: int, node: str,
                 window: float = DEFAULT_WINDOW_SECONDS, max_reports: int = 100) -> None:
        if not 0 < max_reports <= protocol.REPORT_BATCH_MAX:
            raise ValueError(f"max_reports={max_reports} is outside 1..{protocol.REPORT_BATCH_MAX}")
        if window < 0:
            raise ValueError(f"window={window} is negative")
        self.send, self.job_id, self.node = send, job_id, node
        self.window, self.max_reports = window, max_reports
        self.stream = uuid.uuid4().hex
        self.batches = 0
        self._pending: list[protocol.JobReport] = []
        self._due: float | None = None  # (monotonic) when the pending reports must leave
        self._last_sent = float("-inf")  # (monotonic) when the last batch left
        self._lock = threading.Lock()  # guards _pending, _due and _last_sent
        self._send_lock = threading.Lock()  # batches leave one at a time, numbered in send order
        self._wake = threading.Condition(self._lock)
        self._closed = False
        self._timer: threading.Thread | None = None

    def add(self, report: protocol.JobReport) -> None:
        """Queue a report: a step goes at once when no batch left in the last `window` s,
        else with the others `window` s after the last batch; anything else goes now."""
        if report.job_id != self.job_id:
            raise ValueError(f"a report of job {report.job_id} given to job {self.job_id}'s batcher")
        with self._lock:
            if self._closed:
                raise RuntimeError(f"job {self.job_id}'s report batcher is closed")
            self._pending.append(report)
            due = self._last_sent + self.window
            now = (report.kind != "step" or len(self._pending) >= self.max_reports
                   or (len(self._pending) == 1 and due <= time.monotonic()))
            if not now and self._due is None:
                self._due = due
                self._start_timer()
                self._wake.notify()
        if now:
            self.flush()

    def flush(self) -> None:
        """Send what is waiting, if anything, as one batch."""
        with self._send_lock:
            with self._lock:
                reports, self._pending, self._due = self._pending, [], None
                if reports:
                    self._last_sent = time.monotonic()
            if reports:
                self.batches += 1
                self.send(protocol.ReportBatch(job_id=self.job_id, node=self.node, stream=self.stream,
                                               batch=self.batches, reports=tuple(reports)))

    def close(self) -> None:
        """Flush and stop the timer thread (idempotent)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
        self.flush()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join(timeout=5)

    def _start_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Thread(target=self._run, name=f"report-batcher-{self.job_id}", daemon=True)
            self._timer.start()

    def _run(self) -> None:
        """Flush `window` s after the first report of a batch arrived."""
        while True:
            with self._lock:
                while True:
                    if self._closed:
                        return  # (close() flushes)
                    if self._due is None:
                        self._wake.wait()
                        continue
                    left = self._due - time.monotonic()
                    if left <= 0:
                        break
                    self._wake.wait(timeout=left)
            self.flush()
