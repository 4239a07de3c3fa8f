"""A control worker's thread keeps its database connection from task to task, as Django keeps a
web thread's from request to request (CONN_MAX_AGE), and takes a new one when it is broken (a
database restart). Celery's Django fixup closed it before and after every task: each report
batch opened a PostgreSQL connection (controlplane/celery.py, settings.CELERY_DB_REUSE_MAX).
A real worker (the control plane's app, its thread pool) on the real broker and database."""
from __future__ import annotations

import os
import threading
import time

import pytest
from celery.contrib.testing.worker import start_worker
from django.db import connection, connections

from controlplane.celery import app

POSTGRES = os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.timeout(120),
              pytest.mark.skipif(not POSTGRES, reason="SQLite's connections are closed after every use "
                                                      "(CONN_MAX_AGE 0: several processes write one file)")]

QUEUE = "test-worker-connections"
seen: list[int] = []  # the PostgreSQL backend (process id) each task was served by
done = threading.Event()


@app.task(name="test.database_identity")
def database_identity(break_it: bool = False, last: bool = False) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        seen.append(cursor.fetchone()[0])
    if break_it:  # (what a database restart leaves the thread with)
        connection.connection.close()
    if last:  # (the test database is dropped at the end: nothing may stay connected)
        connection.close()
    done.set()


def run_one(**kwargs) -> None:
    done.clear()
    database_identity.apply_async(kwargs=kwargs, queue=QUEUE)
    assert done.wait(30), "the worker did not run the task"
    time.sleep(0.2)  # (its postrun handlers)


@pytest.fixture
def connections_kept():
    """CONN_MAX_AGE as the stack has it (the test run's default is 0), for connections opened now."""
    kept = connections.settings["default"]
    before = kept["CONN_MAX_AGE"]
    kept["CONN_MAX_AGE"] = 60
    yield
    kept["CONN_MAX_AGE"] = before


def test_a_worker_thread_keeps_its_connection_and_replaces_a_broken_one(connections_kept) -> None:
    seen.clear()
    with start_worker(app, pool="threads", concurrency=1, perform_ping_check=False, queues=[QUEUE],
                      loglevel="WARNING", shutdown_timeout=10):
        for _ in range(3):
            run_one()
        run_one(break_it=True)
        run_one(last=True)
    assert len(seen) == 5 and len(set(seen[:4])) == 1, seen  # one connection for four tasks
    assert seen[4] != seen[3]  # the broken one was replaced, and the task after it ran
