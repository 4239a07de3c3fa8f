"""Fault injection for the tests, read from the environment once per rank process."""
from __future__ import annotations

import functools
import os


@functools.cache
def faults() -> frozenset[str]:
    """Fault injection for the tests: DYNAPLANE_FAULT, comma-separated: `exit-in-transfer:R`,
    `hold-in-transfer:R:SECONDS` (a joining rank R, before the transfer's barrier: its peers wait
    the switch's long wait), `stall-in-transfer:R:SECONDS` (a joining rank R, past the barrier:
    its peers wait in the transfer's first round, the step timeout), `exit-after-step:R:S` (rank R exits
    once step S is done, before the step boundary: its peers all fail after that step),
    `exit-before-loss-sum:R:S` (rank R exits once step S's update is done, before the
    all-reduce of its loss: its peers fail in that all-reduce, with step S trained).
    Read once per process (the step loop asks after every step)."""
    return frozenset(item.strip() for item in os.environ.get("DYNAPLANE_FAULT", "").split(",") if item.strip())
