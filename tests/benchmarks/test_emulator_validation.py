"""The validation benchmark's own statistics (benchmarks/emulator_validation.py)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks.emulator_validation import paired_error, round_spread


def test_round_spread_is_each_rounds_distance_from_the_others() -> None:
    # 2.0 against median(2.2, 2.4) = 2.3; 2.2 against 2.2; 2.4 against 2.1
    expected = (abs(2.0 / 2.3 - 1) + 0 + abs(2.4 / 2.1 - 1)) / 3
    assert round_spread([2.0, 2.2, 2.4]) == pytest.approx(expected)
    assert round_spread([1.5, 3.0]) == pytest.approx((0.5 + 1.0) / 2)
    assert round_spread([2.0]) is None


@given(st.floats(0.1, 100), st.integers(2, 8))
def test_identical_rounds_have_no_spread(step: float, rounds: int) -> None:
    assert round_spread([step] * rounds) == pytest.approx(0.0, abs=1e-12)


@given(st.lists(st.floats(0.1, 100), min_size=2, max_size=8), st.floats(0.1, 10))
def test_round_spread_ignores_units(steps: list[float], scale: float) -> None:
    assert round_spread([s * scale for s in steps]) == pytest.approx(round_spread(steps), rel=1e-9)


def test_paired_error_scores_each_round_against_its_own_steps() -> None:
    # Round 2 ran 20% faster and its calibration saw it: paired, both rounds are exact.
    assert paired_error([[1.0, 2.0], [0.8, 1.6]], [[1.0, 2.0], [0.8, 1.6]]) == pytest.approx(0.0)
    assert paired_error([[1.1, 2.0], [0.8, 1.2]], [[1.0, 2.0], [0.8, 1.6]]) == pytest.approx((0.1 + 0 + 0 + 0.25) / 4)
    with pytest.raises(ValueError):
        paired_error([[1.0]], [[1.0], [2.0]])  # a round without its calibration


@given(st.lists(st.lists(st.floats(0.1, 10.0), min_size=3, max_size=3), min_size=1, max_size=4),
       st.floats(0.5, 2.0))
def test_paired_error_is_zero_for_a_perfect_predictor_and_ignores_units(steps: list[list[float]], scale: float) -> None:
    assert paired_error(steps, steps) == pytest.approx(0.0, abs=1e-12)
    shifted = [[s * 1.05 for s in row] for row in steps]
    assert paired_error([[s * scale for s in row] for row in shifted],
                        [[s * scale for s in row] for row in steps]) == pytest.approx(0.05, rel=1e-9)
