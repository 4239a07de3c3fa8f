"""A rank's measured progress through a switch: its state bytes in the planner's wave
shape (parallelism/planner/plan.py RoutingPlan.waves) and a callback after every round, for the
live "round k of R" and the measured memory waves on the dashboard; and the throttle that
keeps rank 0 from sending a report per round.

The measured bytes are the engine's own accounting of the distinct live tensors (the
`sample` callback of execute_plan: state + staging), the quantity the planner predicts;
on CPU torch has no memory statistics to read instead.
"""
from __future__ import annotations

import time
from collections.abc import Callable


class WaveRecorder:
    """execute_plan's `sample` callback. `wave` is [bytes at the start, then per round its
    peak and the bytes after it] (2 * rounds + 1 values when done, like one rank's column
    of the predicted wave); `peak` the highest sample. After each round `on_round(done,
    wave)` is called (done = rounds finished). The engine labels a round's last sample
    "round <k> done"."""

    def __init__(self, on_round: Callable[[int, list[int]], None] | None = None) -> None:
        self.on_round = on_round
        self.wave: list[int] = []
        self.peak = 0
        self._round_peak = 0

    def __call__(self, label: str, live: int) -> None:
        self.peak = max(self.peak, live)
        if label == "start":
            self.wave, self._round_peak = [live], 0
        elif label.startswith("round ") and label.endswith(" done"):
            self.wave += [max(self._round_peak, live), live]
            self._round_peak = 0
            if self.on_round is not None:
                self.on_round(len(self.wave) // 2, list(self.wave))
        elif label.startswith("round "):
            self._round_peak = max(self._round_peak, live)


class Throttle:
    """At most one report per `interval` seconds, but always the first and the last."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval, self.clock = interval, clock
        self._last: float | None = None

    def due(self, *, final: bool = False) -> bool:
        now = self.clock()
        if final or self._last is None or now - self._last >= self.interval:
            self._last = now
            return True
        return False
