"""Rank 0's report batching (agents/runtime/batching.py), with its real timer thread."""
from __future__ import annotations

import threading
import time

import pytest

from agents import protocol
from tests.support.reports import report_of
from agents.runtime.batching import ReportBatcher


def _report(kind: str = "step", step: int = 1, job_id: int = 3) -> protocol.JobReport:
    return report_of(job_id, kind, step=step)


class Sink:
    def __init__(self) -> None:
        self.batches: list[tuple[float, protocol.ReportBatch]] = []
        self.arrived = threading.Condition()

    def __call__(self, batch: protocol.ReportBatch) -> None:
        with self.arrived:
            self.batches.append((time.monotonic(), batch))
            self.arrived.notify_all()

    def wait(self, n: int, timeout: float = 5.0) -> None:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.batches) >= n, timeout=timeout), self.batches

    def steps(self) -> list[list[tuple[str, int]]]:
        return [[(r.kind, r.step) for r in b.reports] for _, b in self.batches]


def test_a_step_after_a_quiet_window_goes_at_once_later_ones_wait_for_the_window() -> None:
    sink = Sink()
    batcher = ReportBatcher(sink, job_id=3, node="node-1", window=0.3)
    batcher.add(_report(step=1))  # nothing sent yet: no reason to wait
    assert sink.steps() == [[("step", 1)]]
    first = sink.batches[0][0]
    for step in (2, 3):
        batcher.add(_report(step=step))
        time.sleep(0.05)
    assert len(sink.batches) == 1  # still inside the window
    sink.wait(2)
    sent_at, batch = sink.batches[1]
    assert 0.28 <= sent_at - first < 1.0  # one window after the last batch
    assert (batch.job_id, batch.node, batch.batch, batch.stream) == (3, "node-1", 2, batcher.stream)
    assert sink.steps()[1] == [("step", 2), ("step", 3)]
    time.sleep(0.35)  # a quiet window: the next step goes at once again
    batcher.add(_report(step=4))
    assert sink.steps()[2] == [("step", 4)] and sink.batches[2][1].batch == 3
    batcher.close()


def test_other_reports_go_at_once_with_the_steps_before_them() -> None:
    sink = Sink()
    batcher = ReportBatcher(sink, job_id=3, node="node-1", window=30)
    batcher.add(_report("started", step=0))
    batcher.add(_report(step=1))
    batcher.add(_report(step=2))
    batcher.add(_report("checkpoint", step=2))
    assert sink.steps() == [[("started", 0)], [("step", 1), ("step", 2), ("checkpoint", 2)]]
    batcher.add(_report(step=3))
    batcher.flush()  # (before a transition report)
    batcher.flush()  # nothing waiting: no empty batch
    batcher.add(_report(step=4))
    batcher.close()  # flushes what waits
    assert sink.steps()[2:] == [[("step", 3)], [("step", 4)]]
    assert [b.batch for _, b in sink.batches] == [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match="closed"):
        batcher.add(_report(step=5))


def test_a_full_batch_leaves_without_waiting() -> None:
    sink = Sink()
    batcher = ReportBatcher(sink, job_id=3, node="node-1", window=30, max_reports=4)
    for step in range(1, 11):
        batcher.add(_report(step=step))
    assert sink.steps() == [[("step", 1)], [("step", s) for s in range(2, 6)], [("step", s) for s in range(6, 10)]]
    batcher.close()
    assert sink.steps()[-1] == [("step", 10)]


def test_reports_from_threads_are_all_sent_once_and_numbered_in_order() -> None:
    sink = Sink()
    batcher = ReportBatcher(sink, job_id=3, node="node-1", window=0.01, max_reports=7)

    def produce(offset: int) -> None:
        for i in range(200):
            batcher.add(_report(step=offset + i))

    threads = [threading.Thread(target=produce, args=(k * 1000,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    batcher.close()
    steps = [s for batch in sink.steps() for _, s in batch]
    assert sorted(steps) == sorted(k * 1000 + i for k in range(4) for i in range(200))
    for k in range(4):  # each producer's own reports keep their order
        mine = [s for s in steps if s // 1000 == k]
        assert mine == sorted(mine)
    assert [b.batch for _, b in sink.batches] == list(range(1, len(sink.batches) + 1))


def test_bad_settings_and_foreign_reports_are_refused() -> None:
    with pytest.raises(ValueError, match="max_reports=0 is outside 1..500"):
        ReportBatcher(print, job_id=3, node="n", max_reports=0)
    with pytest.raises(ValueError, match="window=-1 is negative"):
        ReportBatcher(print, job_id=3, node="n", window=-1)
    with pytest.raises(ValueError, match="a report of job 4 given to job 3's batcher"):
        ReportBatcher(print, job_id=3, node="n").add(_report(job_id=4))
