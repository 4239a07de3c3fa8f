"""Two waits for a rank's collectives, as torchtitan has them: a long one (the order's
`timeout_seconds`) for start-up, checkpoints and switches, where a peer may be busy for a
while, and a short one (`step_timeout_seconds`) for the training steps in between.

Why: a host whose link is cut sends no reset, so its peers learn it is gone only when their
collective times out; with the long wait alone that is minutes (docs/hosts.md, "A host cut
off"). `ProcessGroup.set_timeout` changes a live gloo group's wait for the operations that
follow. torch has no public list of the process groups a trainer made (the layout's meshes,
subgroups, the union world of a switch), so they are taken from c10d's registry, the one
place that knows them all.
"""
from __future__ import annotations

import datetime


def live_groups() -> list:
    """Every process group of this process (the default group included)."""
    from torch.distributed import distributed_c10d

    return list(distributed_c10d._world.pg_map)


def set_wait(seconds: float) -> None:
    """The wait of every live group's next operations."""
    wait = datetime.timedelta(seconds=seconds)
    for group in live_groups():
        group.set_timeout(wait)


class CollectiveTimeouts:
    """Which wait the rank's groups have now: `steady()` between steps, `patient()` around
    whatever may keep a peer busy (a checkpoint, a switch, the first step of a new world)."""

    def __init__(self, long_seconds: float, short_seconds: float) -> None:
        self.long, self.short = long_seconds, min(short_seconds, long_seconds)
        self.now: float | None = None  # (None: the groups' own, the long wait they were made with)

    def steady(self) -> None:
        self._set(self.short)

    def patient(self) -> None:
        self._set(self.long)

    def _set(self, seconds: float) -> None:
        """Only on a change: steady() runs at every step boundary. Groups are made only while
        the wait is long (start-up, a switch, a checkpoint), so the next change reaches them."""
        if seconds != self.now:
            set_wait(seconds)
            self.now = seconds
