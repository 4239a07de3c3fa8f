from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _fast_password_hashing(settings):
    """Tests sign users in all the time; PBKDF2's 1M iterations take 1-3 s a hash on the CI
    machine. A fast hasher is Django's own advice for tests; production keeps PBKDF2."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
