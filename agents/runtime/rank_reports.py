"""Rank 0's reports to the control plane (other ranks stay silent)."""
from __future__ import annotations

import datetime
import os

from agents import protocol
from agents.seal import AGENT_KEY_ENV, AgentKey, SealError, seal


# How long a finished rank 0 waits for the broker to take its last reports (an outage at the
# job's end): then they are lost and the rank exits.
EXIT_DRAIN_SECONDS = 15.0


class Reporter:
    """Sends reports to the control queue (rank 0 only; other ranks stay silent). Job
    reports travel in batches (agents/runtime/batching.py, task control.ingest_events);
    a transition report first flushes the steps before it. Everything goes through an
    outbox (agents/runtime/outbox.py): in order, kept through a broker outage, never
    blocking or failing the training loop."""

    def __init__(self, job_id: int, rank: int, node: str, broker_url: str | None,
                 restore_id: int | None = None) -> None:
        self.job_id, self.node, self.restore_id = job_id, node, restore_id
        self.app = self.batcher = self.outbox = None
        if rank == 0 and broker_url:
            import atexit

            from celery import Celery

            from agents.runtime.batching import ReportBatcher

            from agents.runtime.outbox import Outbox

            try:  # the agent's key, sealing what rank 0 says for the agent's node (agents/seal.py)
                self.key: AgentKey | None = AgentKey.decode(os.environ.get(AGENT_KEY_ENV, ""))
            except SealError:
                print(f"rank 0: no agent key in ${AGENT_KEY_ENV}: the control plane will refuse these reports",
                      flush=True)
                self.key = None
            self.app = Celery(f"job-{job_id}-rank-0", broker=broker_url, set_as_current=False)
            self.app.conf.update(task_serializer="json", broker_connection_retry_on_startup=True,
                                 broker_connection_timeout=4.0,
                                 broker_transport_options={"socket_connect_timeout": 4, "socket_timeout": 10})
            self.outbox = Outbox(self._publish, name=f"job {job_id} rank 0 reports")
            self.batcher = ReportBatcher(lambda batch: self._send(protocol.CONTROL_INGEST_EVENTS, batch),
                                         job_id=job_id, node=node)
            atexit.register(self.close)

    def _publish(self, task: str, message) -> None:
        """One try (the outbox tries again): raises when the broker does not take it."""
        body = message.model_dump(mode="json")
        self.app.send_task(task, args=[body], kwargs={"seal": seal(self.key, self.node, task, body)},
                           queue=protocol.CONTROL_QUEUE, retry=False)

    def _send(self, task: str, message) -> None:
        if self.outbox is not None:
            self.outbox.put(task, message)

    def close(self, timeout: float = EXIT_DRAIN_SECONDS) -> None:
        """At exit: the waiting steps out, and up to `timeout` s for the broker to take them."""
        self.batcher.close()
        self.outbox.close(timeout)

    def job(self, kind: str, **fields) -> None:
        if self.batcher is not None:
            self.batcher.add(protocol.job_report(job_id=self.job_id, node=self.node, kind=kind, sent_at=now(),
                                                **{"restore_id": self.restore_id, **fields}))

    def transition(self, transition_id: int, state: str, **fields) -> None:
        if self.batcher is not None:
            self.batcher.flush()
        self._send(protocol.CONTROL_TRANSITION_REPORT, protocol.TransitionReport(
            job_id=self.job_id, transition_id=transition_id, node=self.node, state=state, sent_at=now(), **fields))


def now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)
