"""Rank 0's messages to the control plane, kept until the broker takes them: a rank never dies
for a report (issue 43).

Training puts a message in and goes on: `put` neither blocks nor raises. One sender thread
publishes the messages in the order they were put. When the broker does not answer (a restart,
a failover, a network blip) the sender keeps the head message and tries again with a growing
pause (0.2 s doubling to 2 s), so after an outage of minutes everything is sent, in order, with
the batch numbers it had: the control plane applies each batch once (controlplane/jobs/ingest.py).

A broker that restarts loses what it held and had not delivered (a Redis without persistence,
or killed between snapshots): batches published in the last seconds before the outage may never
reach the control plane. So at the first failed try the sender puts the ReportBatches it
published in the last `replay_seconds` back at the head of the queue, in order; the control
plane ignores those it applied already (same stream, same number), and records once those it had
not: a step is recorded once, whatever is resent.

The buffer is bounded (`bound` messages; a ReportBatch holds up to protocol.REPORT_BATCH_MAX
reports, so the default keeps at least 20,000 steps' reports: over half an hour at 10 steps/s
one per batch, far more when batched). Past it the oldest message is dropped; the next batch of
that stream says which batches were dropped (`ReportBatch.dropped`), so the control plane
applies it at once and records the gap instead of waiting for batches that will never come.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from pydantic import BaseModel

from agents import protocol

log = logging.getLogger(__name__)

DEFAULT_BOUND = 20_000
REPLAY_SECONDS = 30.0
FIRST_PAUSE, LONGEST_PAUSE = 0.2, 2.0


class Outbox:
    """Ordered, bounded, resent until taken. `publish(task, message)` raises when the broker
    does not take the message (kombu's OperationalError, an OSError, ...)."""

    def __init__(self, publish: Callable[[str, BaseModel], None], *, bound: int = DEFAULT_BOUND,
                 replay_seconds: float = REPLAY_SECONDS, name: str = "outbox") -> None:
        if bound < 1:
            raise ValueError(f"bound={bound}: the outbox must hold at least one message")
        self.publish, self.bound, self.name, self.replay_seconds = publish, bound, name, replay_seconds
        self.sent = self.dropped = self.replayed = 0
        self._recent: deque[tuple[float, str, BaseModel]] = deque()  # batches sent, newest last
        self.outages = 0  # times the broker stopped answering
        self._queue: deque[list] = deque()  # [task, message, tried]: a message tried once is never changed
        self._lost: dict[str, tuple[int, int]] = {}  # stream -> (first, last) batch dropped, not yet said
        self._lock = threading.Condition()
        self._closed = self._in_flight = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, task: str, message: BaseModel) -> None:
        """Queue a message for the broker; past the bound the oldest one not being sent is dropped."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name} is closed")
            self._queue.append([task, message, False])
            while len(self._queue) > self.bound:
                oldest = 1 if self._in_flight else 0
                task, dropped, _ = self._queue[oldest]
                del self._queue[oldest]
                self._drop(task, dropped)
            self._lock.notify()

    def waiting(self) -> int:
        with self._lock:
            return len(self._queue)

    def close(self, timeout: float) -> bool:
        """Stop taking messages and wait up to `timeout` s for the sender to hand over the rest;
        True when nothing was left behind."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout)
        left = self.waiting()
        if left:
            print(f"{self.name}: {left} message(s) to the control plane not sent: the broker did not answer "
                  f"within {timeout:.0f} s", file=sys.stderr, flush=True)
        return left == 0

    def _drop(self, task: str, message: BaseModel) -> None:
        self.dropped += 1
        if isinstance(message, protocol.ReportBatch):
            first, _ = self._lost.get(message.stream, (message.batch, message.batch))
            self._lost[message.stream] = (min(first, message.batch), message.batch)

    def _take_recent(self, now: float) -> int:
        """Put the batches sent in the last replay_seconds back at the head, in order (lock held)."""
        recent = [[task, message, True] for at, task, message in self._recent if at >= now - self.replay_seconds]
        self._recent.clear()
        self._queue.extendleft(reversed(recent))
        self.replayed += len(recent)
        return len(recent)

    def _next(self) -> tuple[str, BaseModel] | None:
        """The head message (left in the queue until sent), the batches dropped before it said."""
        with self._lock:
            while not self._queue and not self._closed:
                self._lock.wait()
            if not self._queue:
                return None
            task, message, tried = self._queue[0]
            if not tried and isinstance(message, protocol.ReportBatch):
                message = self._merged(message)
                if message.stream in self._lost:
                    message = message.model_copy(update={"dropped": self._lost.pop(message.stream)})
                self._queue[0] = [task, message, True]
            self._in_flight = True
            return task, message

    def _merged(self, head: protocol.ReportBatch) -> protocol.ReportBatch:
        """The head batch with the untried batches of its stream right behind it, as one message
        (the backlog of an outage leaves in a few messages: fewer for the control plane to order
        and apply). Only untried messages change: one that may have reached the broker never does.
        (lock held)"""
        reports, covers = list(head.reports), head.covers
        while len(self._queue) > 1:
            task, following, tried = self._queue[1]
            if (tried or not isinstance(following, protocol.ReportBatch) or following.stream != head.stream
                    or following.batch != head.batch + covers or following.dropped is not None
                    or len(reports) + len(following.reports) > protocol.REPORT_BATCH_MAX):
                break
            reports += following.reports
            covers += following.covers
            del self._queue[1]
        if covers == head.covers:
            return head
        return head.model_copy(update={"reports": tuple(reports), "covers": covers})

    def _run(self) -> None:
        pause, down_since = FIRST_PAUSE, None
        while (item := self._next()) is not None:
            try:
                self.publish(*item)
            except Exception as exc:  # the broker did not take it: keep it, try again
                with self._lock:
                    self._in_flight = False
                    if down_since is None:
                        down_since = time.monotonic()
                        self.outages += 1
                        replay = self._take_recent(down_since)
                        print(f"{self.name}: the control plane's broker does not answer ({type(exc).__name__}: "
                              f"{exc}); training goes on, its reports are kept and resent ({replay} sent in the "
                              f"last {self.replay_seconds:.0f} s with them)", file=sys.stderr, flush=True)
                    self._lock.wait(timeout=pause)  # (close() wakes it: one more try, then the join's timeout)
                pause = min(LONGEST_PAUSE, pause * 2)
                continue
            with self._lock:
                self._queue.popleft()  # the head: put() never drops a message in flight
                self._in_flight = False
                self.sent += 1
                if isinstance(item[1], protocol.ReportBatch):
                    now = time.monotonic()
                    self._recent.append((now, *item))
                    while self._recent and self._recent[0][0] < now - self.replay_seconds:
                        self._recent.popleft()
            if down_since is not None:
                print(f"{self.name}: the broker answers again after {time.monotonic() - down_since:.1f} s; "
                      f"{self.waiting()} message(s) still to send", file=sys.stderr, flush=True)
                pause, down_since = FIRST_PAUSE, None
