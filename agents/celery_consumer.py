"""The Celery consumer of the control worker and the agents, reconnecting to the broker within
a second of its return. Celery's own backs off 2, 4, 6 ... 30 s between tries: after a 30 s
outage the control worker came back 12 s after the broker, after two minutes up to 30 s, and
every report and order waited that long (issue 43). Its users also set
broker_connection_max_retries=None: at a try a second, Celery's default of 100 tries ended the
agent (and its ranks) after 100 s without a broker."""
from __future__ import annotations

import functools

from celery.worker.consumer import Consumer

RETRY_SECONDS = 0.5  # first pause; then 1.0 s between tries


class QuickReconnectConsumer(Consumer):
    def ensure_connected(self, conn):
        conn.ensure_connection = functools.partial(conn.ensure_connection, interval_start=RETRY_SECONDS,
                                                   interval_step=RETRY_SECONDS, interval_max=2 * RETRY_SECONDS)
        return super().ensure_connected(conn)


CONSUMER = f"{__name__}:QuickReconnectConsumer"
