from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """Tests sign users in all the time; PBKDF2's 1M iterations take 1-3 s a hash on the CI
    machine. A fast hasher is Django's own advice for tests; production keeps PBKDF2."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]




@pytest.fixture(scope="session")
def _shared_stack(tmp_path_factory):
    """One running stack (2 agents x 2 virtual GPUs) on the test Redis and a fresh database,
    for every test module that uses `stack` (tests/support/stack.py, SharedStack)."""
    import os

    from tests.support.stack import SharedStack, empty_redis_db, isolated_database

    with isolated_database() as database_url:
        process = SharedStack(
            tmp_path_factory.mktemp("stack"),
            env={"DATABASE_URL": database_url, "REDIS_URL": empty_redis_db(os.environ["REDIS_URL"], 3)},
        )
        process.start()
        try:
            process.ready_seconds = process.wait_ready()
            yield process
        finally:
            process.stop()


@pytest.fixture
def stack(_shared_stack):
    """The shared stack, with every agent running, every node healthy and every GPU free."""
    _shared_stack.ready_for_test()
    return _shared_stack
