"""At most N emulations at a time on an agent, so its job orders are never queued behind them.

The agent's Celery worker serves node.<name> (job start, switch, stop: each must run within
seconds) and the shared emulate queue (a run can take a minute) on one thread pool. Celery
has no per-queue concurrency inside one worker, so an emulation that finds every slot taken
sends its order back to the emulate queue (another agent, or this one later, takes it) and
frees its thread at once. The pool is sized slots + ORDER_THREADS, so job orders always find
a thread.
"""
from __future__ import annotations

import threading
from collections.abc import Callable

ORDER_THREADS = 2  # threads kept for node.<name> orders beside the emulation slots
RETRY_SECONDS = 0.2  # a requeued order waits this long before an agent takes it again (a cached run takes 0.1 s)


class EmulationSlots:
    """A non-blocking counter of the emulations running on this agent."""

    def __init__(self, slots: int = 1) -> None:
        if slots < 1:
            raise ValueError(f"emulation slots must be at least 1 (got {slots})")
        self.slots = slots
        self._free = threading.BoundedSemaphore(slots)

    def run_or_requeue(self, work: Callable[[], None], requeue: Callable[[], None]) -> bool:
        """Run `work` in a free slot and return True; with none free, call `requeue` (which
        sends the order back) and return False without waiting."""
        if not self._free.acquire(blocking=False):
            requeue()
            return False
        try:
            work()
        finally:
            self._free.release()
        return True


def pool_size(slots: int) -> int:
    """Worker threads for an agent with `slots` emulation slots."""
    return slots + ORDER_THREADS
