"""The timeline benchmark's pairing of real and emulated actions (benchmarks/emulator_timeline.py)."""
from __future__ import annotations

from benchmarks.emulator_timeline import paired_actions


def test_each_ranks_nth_action_of_a_kind_meets_the_emulators_nth() -> None:
    real = [[("forward", 0.0, 0.02), ("forward", 0.02, 0.04), ("backward", 0.16, 0.26), ("optimizer", 0.44, 0.63)],
            [("forward", 0.02, 0.05), ("backward", 0.05, 0.16)]]
    emulated = [(0, "backward", 0.17, 0.26), (0, "forward", 0.0, 0.03), (0, "forward", 0.03, 0.05),
                (1, "forward", 0.03, 0.06), (1, "backward", 0.06, 0.17), (1, "backward", 0.2, 0.31),
                (0, "optimizer", 0.40, 0.58)]
    rows = paired_actions(real, emulated)
    assert rows[:4] == [(0, "forward", 0, (0.0, 0.02), (0.0, 0.03)), (0, "forward", 1, (0.02, 0.04), (0.03, 0.05)),
                        (0, "backward", 0, (0.16, 0.26), (0.17, 0.26)), (0, "optimizer", 0, (0.44, 0.63), (0.40, 0.58))]
    # rank 1: the emulator has a second backward the real run did not show
    assert rows[4:] == [(1, "forward", 0, (0.02, 0.05), (0.03, 0.06)), (1, "backward", 0, (0.05, 0.16), (0.06, 0.17)),
                        (1, "backward", 1, None, (0.2, 0.31))]


def test_a_real_action_the_emulator_lacks_pairs_with_none() -> None:
    assert paired_actions([[("optimizer", 0.1, 0.2)]], []) == [(0, "optimizer", 0, (0.1, 0.2), None)]
