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

    def steady(self) -> None:
        set_wait(self.short)

    def patient(self) -> None:
        set_wait(self.long)
