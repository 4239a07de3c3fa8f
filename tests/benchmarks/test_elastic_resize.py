"""The benchmark's outside measure of a pause, when polling misses short steps."""
from __future__ import annotations

import math

from benchmarks.elastic_resize import observed_pause


class Seen:
    """A job as the poller saw it: when each step number was first seen, and each step's
    trained seconds (the job's step_seconds series)."""

    def __init__(self, seen: dict[int, float], seconds: dict[int, float]) -> None:
        self.seen, self.seconds = seen, seconds

    def steps_seconds(self, first: int, last: int) -> float:
        return sum(self.seconds.get(step, float("nan")) for step in range(first, last + 1))


def test_every_step_seen() -> None:
    old = Seen({9: 100.0, 10: 101.0}, {10: 1.0})
    new = Seen({11: 104.0}, {11: 1.5})
    assert observed_pause(old, new, 10) == 104.0 - 1.5 - 101.0


def test_short_steps_missed_by_the_poller_are_accounted_from_their_seconds() -> None:
    # Steps of 0.02 s, polled every 0.1 s: old step 10 and new steps 11-12 were never seen.
    old = Seen({8: 50.00}, {9: 0.02, 10: 0.02})
    new = Seen({13: 50.50}, {11: 0.02, 12: 0.02, 13: 0.02})
    assert math.isclose(observed_pause(old, new, 10), (50.50 - 0.06) - (50.00 + 0.04))


def test_nothing_seen_is_not_a_number() -> None:
    assert math.isnan(observed_pause(Seen({}, {}), Seen({11: 1.0}, {11: 0.1}), 10))
    assert math.isnan(observed_pause(Seen({10: 1.0}, {}), Seen({}, {}), 10))
