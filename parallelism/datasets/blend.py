"""Blends: sample i of a blend comes from part k with the parts' weights, a pure function of i.

Megatron precomputes its blend index greedily for a known sample count (each next sample goes to
the part furthest behind its share). An endless run has no count, so the greedy order is computed
once for a period of P samples whose per-part counts are the largest-remainder apportionment of
P x weights, and repeated: part k's j-th sample within period b is its sample b * count_k + j. Each
part's share is exact to 1/P at every period boundary and within one sample inside a period.
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
    share = np.asarray(counts, dtype=np.float64) / period
    taken = np.zeros(len(counts), dtype=np.int64)
    part = np.empty(period, dtype=np.int64)
    rank = np.empty(period, dtype=np.int64)
    for n in range(period):
        behind = share * (n + 1) - taken
        behind[taken >= np.asarray(counts)] = -np.inf
        k = int(np.argmax(behind))
        part[n], rank[n] = k, taken[k]
        taken[k] += 1
    return BlendIndex(part, rank, tuple(counts))


def locate(index: BlendIndex, i: int) -> tuple[int, int]:
    """(part, that part's sample index) of blend sample i."""
    period = len(index.part)
    block, r = divmod(i, period)
    k = int(index.part[r])
    return k, block * index.counts[k] + int(index.rank[r])
