"""A stream's events put back in seq order before they reach a page (pure: no I/O).

Seqs are allocated in commit order, but each writer sends its events after its own commit, from
its own thread or process: with two control workers, batch n+1 of a job's steps can reach the
channel layer before batch n (benchmarks/cluster_scale.py saw 2-5 in 11,400 arrive so), and a page
takes a seq that skips one for a lost event and reloads its snapshot. The websocket holds an event
that comes ahead of a missing one until the missing one arrives, or until the hold expires (the
missing one was lost: a broker hiccup); then the held ones go on in order and the page sees the gap.
"""
from __future__ import annotations

HOLD_SECONDS = 0.5  # how long an event ahead of a missing seq waits for it


class InOrder:
    """Events (dicts with an int `seq`) of one stream, released in seq order after `last`."""

    def __init__(self, last: int) -> None:
        self.last = last  # the last seq released (the hello's seq at first)
        self.held: dict[int, dict] = {}

    def arrive(self, event: dict) -> list[dict]:
        """The events to send now, in order (an event at or before `last`, a late one or one from
        before the hello, is sent as it is: the page ignores what it already has)."""
        seq = event["seq"]
        if seq <= self.last:
            return [event]
        self.held[seq] = event
        out = []
        while self.last + 1 in self.held:
            self.last += 1
            out.append(self.held.pop(self.last))
        return out

    @property
    def waiting(self) -> bool:
        return bool(self.held)

    def release(self) -> list[dict]:
        """The hold expired: everything held, in seq order (the missing seqs stay missing)."""
        out = [self.held[seq] for seq in sorted(self.held)]
        if out:
            self.last = out[-1]["seq"]
        self.held.clear()
        return out
