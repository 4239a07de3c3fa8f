"""Rank 0's outbox (agents/runtime/outbox.py): training never waits for or dies of the broker; what
it reports arrives in order, each batch at least once, across a real broker's outage."""
from __future__ import annotations

import threading
import time

import pytest
from kombu import Connection
from kombu.exceptions import OperationalError

from agents import protocol
from agents.runtime.outbox import Outbox
from agents.runtime.rank_reports import Reporter
from tests.support.broker import Broker
from tests.support.reports import report_of


def _batch(number: int, stream: str = "s") -> protocol.ReportBatch:
    return protocol.ReportBatch(job_id=3, node="node-1", stream=stream, batch=number,
                                reports=(report_of(3, "step", step=number),))


class Publisher:
    """Takes messages while `up` is set, else raises as kombu does when the broker is gone."""

    def __init__(self) -> None:
        self.up, self.taken, self.tries = threading.Event(), [], 0
        self.up.set()

    def __call__(self, task: str, message) -> None:
        self.tries += 1
        if not self.up.is_set():
            raise OperationalError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")
        self.taken.append((task, message))


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_messages_wait_out_an_outage_and_leave_in_order_with_the_recent_ones_again() -> None:
    publisher = Publisher()
    outbox = Outbox(publisher, replay_seconds=60)
    for n in (1, 2):
        outbox.put("t", _batch(n))
    _wait(lambda: sum(m.covers for _, m in publisher.taken) == 2)
    before = len(publisher.taken)  # (1 or 2 messages: put together, they may leave as one)
    publisher.up.clear()
    started = time.monotonic()
    for n in range(3, 9):
        outbox.put("t", _batch(n))
    assert time.monotonic() - started < 0.05  # put never waits for the broker
    _wait(lambda: publisher.tries >= 4)  # it keeps trying
    assert outbox.waiting() >= 1 + before and outbox.outages == 1  # the replayed ones and the backlog
    publisher.up.set()
    _wait(lambda: outbox.waiting() == 0)
    numbers = [n for _, m in publisher.taken for n in range(m.batch, m.batch + m.covers)]
    steps = [r.step for _, m in publisher.taken for r in m.reports]
    # 1-2 before the outage, again at its start (the broker may have lost them), then the rest,
    # the backlog merged into fewer messages (each batch number once, its reports in order)
    assert numbers == steps == [1, 2, 1, 2, 3, 4, 5, 6, 7, 8] and outbox.replayed == before
    assert len(publisher.taken) < 10  # the replayed messages went as they were, the backlog merged
    assert outbox.close(1.0) is True


def test_past_its_bound_the_oldest_are_dropped_and_the_next_batch_names_them() -> None:
    publisher = Publisher()
    publisher.up.clear()
    outbox = Outbox(publisher, bound=3)
    for n in range(1, 8):
        outbox.put("t", _batch(n))
    assert outbox.dropped == 4 and outbox.waiting() == 3
    publisher.up.set()
    _wait(lambda: outbox.waiting() == 0)
    # the last three kept (or batch 1 too, when it was in flight then: never dropped mid-send);
    # the first batch after the dropped ones names them (and carries the rest of the backlog)
    taken = [(m.batch, m.covers, m.dropped) for _, m in publisher.taken]
    assert taken in ([(5, 3, (1, 4))], [(1, 1, None), (6, 2, (2, 5))]), taken
    assert outbox.close(1.0)


def test_a_bound_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one"):
        Outbox(Publisher(), bound=0)


def test_close_gives_up_after_its_timeout_when_the_broker_stays_away(capfd) -> None:
    publisher = Publisher()
    publisher.up.clear()
    outbox = Outbox(publisher)
    outbox.put("t", _batch(1))
    started = time.monotonic()
    assert outbox.close(0.5) is False
    assert time.monotonic() - started < 2
    assert "1 message(s) to the control plane not sent" in capfd.readouterr().err
    with pytest.raises(RuntimeError, match="closed"):
        outbox.put("t", _batch(2))


def _drain(url: str, into: dict[int, protocol.ReportBatch], until, timeout: float = 20.0) -> None:
    """Read the control queue as the control worker would (Celery's message: [args, kwargs, embed])."""
    deadline = time.monotonic() + timeout
    with Connection(url) as connection:
        queue = connection.SimpleQueue(protocol.CONTROL_QUEUE)
        while not until():
            assert time.monotonic() < deadline, sorted(into)
            try:
                message = queue.get(block=True, timeout=0.5)
            except queue.Empty:
                continue
            batch = protocol.ReportBatch.model_validate(message.payload[0][0])
            assert into.setdefault(batch.batch, batch) == batch  # a batch resent is the same batch
            message.ack()
        queue.close()


def test_a_rank_reporter_through_a_real_broker_killed_and_started_again(tmp_path) -> None:
    broker = Broker(tmp_path / "broker")
    reporter = Reporter(3, 0, "node-1", broker.url)
    try:
        got: dict[int, protocol.ReportBatch] = {}

        def steps() -> list[int]:
            return sorted(r.step for b in got.values() for r in b.reports)

        for step in range(1, 6):
            reporter.job("step", step=step, loss=1.0, step_seconds=0.1, tokens_per_second=1.0, layout="dp=1")
        _drain(broker.url, got, lambda: steps() == [1, 2, 3, 4, 5])
        reporter.job("step", step=6, loss=1.0, step_seconds=0.1, tokens_per_second=1.0, layout="dp=1")
        time.sleep(0.7)  # step 6 left for the broker: the kill loses it there, undelivered
        broker.down()
        started = time.monotonic()
        for step in range(7, 20):
            reporter.job("step", step=step, loss=1.0, step_seconds=0.1, tokens_per_second=1.0, layout="dp=1")
            time.sleep(0.05)
        assert time.monotonic() - started < 13 * 0.05 + 0.5  # training never waited
        broker.up()
        _drain(broker.url, got, lambda: steps()[-1:] == [19])
        assert steps() == list(range(1, 20))  # every step once, none lost with the broker
        assert sorted(got) == list(range(1, len(got) + 1))  # batches numbered without a gap
        assert reporter.outbox.outages == 1 and reporter.outbox.replayed >= 1
    finally:
        reporter.close(timeout=2)
        broker.close()
