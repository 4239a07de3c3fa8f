"""Blends: sample i of a blend comes from part k with the parts' weights, a pure function of i.

Megatron precomputes its blend index greedily for a known sample count (each next sample goes to
the part furthest behind its share). An endless run has no count, so the order is computed once
for a period of P samples whose per-part counts are the largest-remainder apportionment of
P x weights, and repeated: part k's j-th sample within period b is its sample b * count_k + j. Each
part's share is exact to 1/P at every period boundary and within one sample inside a period.

Megatron's greedy rule does not keep that last promise (weights 6, 6, 6, 0.5, 0.5 over 53: a
part falls 1.02 samples behind; hypothesis found it). So the period is scheduled as unit jobs
with windows: part k's j-th sample (1-based) must come after position (j - 1) / share_k (else the
part runs a sample ahead from there) and by position ceil(j / share_k) (else it falls a sample
behind before it comes); earliest deadline first among the released ones
finds such a schedule whenever one exists, and one always does (Tijdeman's chairman-assignment
theorem bounds the best prefix error by 1 - 1/(2(K - 1)) for K parts). Integer arithmetic: no
rounding decides a position.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallelism.datasets.errors import DatasetError

DEFAULT_PERIOD = 1000


def apportion(weights: list[float], period: int) -> list[int]:
    """Largest-remainder counts summing to `period` (ties to the earlier part)."""
    if not weights or any(not w > 0 for w in weights):
        raise DatasetError(f"blend weights {weights} must all be positive")
    total = sum(weights)
    exact = [w / total * period for w in weights]
    counts = [int(e) for e in exact]
    for k in sorted(range(len(weights)), key=lambda k: (-(exact[k] - counts[k]), k))[:period - sum(counts)]:
        counts[k] += 1
    return counts


@dataclass(frozen=True)
class BlendIndex:
    part: np.ndarray          # int64 [P]: the part of each position of the period
    rank: np.ndarray          # int64 [P]: which of its part's samples in the period it is
    counts: tuple[int, ...]   # samples of each part per period


def build_blend(weights: list[float], period: int = DEFAULT_PERIOD) -> BlendIndex:
    if period < len(weights):
        raise DatasetError(f"blend period {period} is shorter than the {len(weights)} parts")
    counts = apportion(weights, period)
    taken = [0] * len(counts)
    part = np.empty(period, dtype=np.int64)
    rank = np.empty(period, dtype=np.int64)

    def window(k: int) -> tuple[int, int]:
        """(first, last) 1-based position the next sample of part k may take (see the docstring)."""
        j = taken[k] + 1
        return (j - 1) * period // counts[k] + 1, (j * period + counts[k] - 1) // counts[k]

    for n in range(1, period + 1):
        ready = [(window(k)[1], k) for k in range(len(counts)) if taken[k] < counts[k] and window(k)[0] <= n]
        if not ready:
            raise AssertionError(f"blend schedule stuck at position {n} of {period} (counts {counts})")
        deadline, k = min(ready)
        if deadline < n:
            raise AssertionError(f"blend schedule missed part {k}'s deadline {deadline} at position {n}")
        part[n - 1], rank[n - 1] = k, taken[k]
        taken[k] += 1
    return BlendIndex(part, rank, tuple(counts))


def locate(index: BlendIndex, i: int) -> tuple[int, int]:
    """(part, that part's sample index) of blend sample i."""
    period = len(index.part)
    block, r = divmod(i, period)
    k = int(index.part[r])
    return k, block * index.counts[k] + int(index.rank[r])
