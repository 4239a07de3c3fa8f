"""When a node's reported host stats (CPU, memory) replace the ones the pages show.

The shown values travel in NodeView, and the cluster stream's snapshot invariant holds
only if every change of them is an event; a node's CPU moves with every heartbeat, so
the shown values move only when the change is worth an event: the first report, a CPU
change of CPU_STEP points, a memory change of MEMORY_STEP of the total, a new core count
or total, or any change at all once REFRESH_SECONDS have passed since the last one shown.
Pure: no database."""
from __future__ import annotations

from dataclasses import dataclass

CPU_STEP = 5.0  # percentage points
MEMORY_STEP = 0.01  # of the total
REFRESH_SECONDS = 30.0


@dataclass(frozen=True, slots=True)
class Shown:
    cpu_percent: float
    cpu_count: int
    memory_used_bytes: int
    memory_total_bytes: int


def worth_showing(shown: Shown | None, reported: Shown | None, seconds_since_shown: float | None) -> bool:
    """Whether `reported` replaces `shown` (None reported: the agent sent none; keep them)."""
    if reported is None:
        return False
    if shown is None or seconds_since_shown is None:
        return True
    if reported == shown:
        return False
    if (reported.cpu_count, reported.memory_total_bytes) != (shown.cpu_count, shown.memory_total_bytes):
        return True
    if abs(reported.cpu_percent - shown.cpu_percent) >= CPU_STEP:
        return True
    if abs(reported.memory_used_bytes - shown.memory_used_bytes) >= MEMORY_STEP * reported.memory_total_bytes:
        return True
    return seconds_since_shown >= REFRESH_SECONDS
