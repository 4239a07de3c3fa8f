"""Blends: exact shares per period, every part's samples taken once each, in order."""
from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from parallelism.datasets.blend import apportion, build_blend, locate

weights = st.lists(st.floats(0.01, 10), min_size=1, max_size=5)


@given(weights, st.integers(5, 400))
def test_apportion_is_largest_remainder(ws, period):
    counts = apportion(ws, period)
    assert sum(counts) == period
    exact = [w / sum(ws) * period for w in ws]
    assert all(abs(c - e) < 1 for c, e in zip(counts, exact))


@settings(deadline=None, max_examples=40)
@given(weights, st.integers(5, 200), st.integers(1, 4))
def test_each_part_reads_its_samples_once_in_order(ws, period, blocks):
    index = build_blend(ws, period)
    taken = [[] for _ in ws]
    for i in range(period * blocks):
        k, local = locate(index, i)
        taken[k].append(local)
    for k, got in enumerate(taken):
        assert got == list(range(index.counts[k] * blocks))


@settings(deadline=None, max_examples=200)
@given(weights, st.integers(5, 200))
@example([6.0, 6.0, 6.0, 0.5, 0.5], 53)  # Megatron's greedy rule falls 1.02 samples behind here
def test_shares_within_one_sample_of_the_target_inside_a_period(ws, period):
    """The interleave (earliest deadline first) keeps every prefix within one sample of its share."""
    index = build_blend(ws, period)
    share = np.asarray(index.counts) / period
    seen = np.zeros(len(ws))
    for n in range(period):
        seen[index.part[n]] += 1
        assert np.all(np.abs(seen - share * (n + 1)) < 1 + 1e-9)
