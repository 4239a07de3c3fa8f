"""The measured wave and the report throttle of a switch (parallelism/engine/progress.py)."""
from __future__ import annotations

from parallelism.engine.progress import Throttle, WaveRecorder


def test_wave_has_the_planners_shape_start_then_peak_and_after_per_round() -> None:
    calls = []
    recorder = WaveRecorder(lambda done, wave: calls.append((done, wave)))
    for label, live in [("start", 100), ("round 0 packed", 140), ("round 0 exchange", 180), ("round 0 done", 90),
                        ("round 1 local", 95), ("round 1 done", 60), ("derived", 70)]:
        recorder(label, live)
    assert recorder.wave == [100, 180, 90, 95, 60] and recorder.peak == 180
    assert calls == [(1, [100, 180, 90]), (2, [100, 180, 90, 95, 60])]


def test_throttle_lets_the_first_and_last_through_and_one_per_interval() -> None:
    now = [0.0]
    throttle = Throttle(0.5, clock=lambda: now[0])
    sent = []
    for i in range(10):  # a report per 0.1 s for 1 s
        now[0] = i * 0.1
        sent.append(throttle.due(final=i == 9))
    assert [i for i, due in enumerate(sent) if due] == [0, 5, 9]
