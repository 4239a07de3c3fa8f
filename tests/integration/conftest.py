from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.support.stack import StackProcess, isolated_database


def _separate_redis_db(url: str, db: int) -> str:
    """The stack under test gets its own Redis database number, so its queues never mix
    with another run's on a shared server."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{db}"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A running stack (2 agents x 2 virtual GPUs) on the test Redis and a fresh database."""
    import os

    with isolated_database() as database_url:
        process = StackProcess(
            tmp_path_factory.mktemp("stack"),
            env={"DATABASE_URL": database_url, "REDIS_URL": _separate_redis_db(os.environ["REDIS_URL"], 3)},
        )
        process.start()
        try:
            process.ready_seconds = process.wait_ready()
            yield process
        finally:
            process.stop()
