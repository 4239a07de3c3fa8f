"""Which state elements a set of surviving ranks still holds under a layout (pure).

After a node loss, the job can be rebuilt from its survivors alone only if, for every
logical tensor and every state class (param; the optimizer's fp32 states), the union of
the boxes the surviving ranks hold covers the whole tensor: e.g. dp=2 over two nodes
keeps one full replica on either node (zero=0), while zero>=1 spreads the optimizer
states over the data-parallel ranks so that losing one of them loses a chunk of them.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from parallelism.layout.placement import Placement
from parallelism.layout.shards import OPTIM, PARAM, b_dim, holder_boxes


def _covers(a_len: int, b_len: int, a0, a1, b0, b1) -> bool:
    """Do the rectangles [a0, a1) x [b0, b1) cover [0, a_len) x [0, b_len)? (compressed grid)"""
    if a_len == 0 or b_len == 0:
        return True
    if len(a0) == 0:
        return False
    a_cuts = np.unique(np.concatenate([[0, a_len], a0, a1]))
    b_cuts = np.unique(np.concatenate([[0, b_len], b0, b1]))
    covered = np.zeros((len(a_cuts) - 1, len(b_cuts) - 1), dtype=bool)
    for i in range(len(a0)):
        ai, aj = np.searchsorted(a_cuts, [a0[i], a1[i]])
        bi, bj = np.searchsorted(b_cuts, [b0[i], b1[i]])
        covered[ai:aj, bi:bj] = True
    return bool(covered.all())


def uncovered(placement: Placement, survivors: Iterable[int]) -> list[tuple[str, str]]:
    """(tensor name, state class) pairs that the surviving ranks do not hold in full,
    in model order; empty when the survivors hold every element of the state."""
    alive = np.array(sorted(set(survivors)), dtype=np.int64)
    missing = []
    for tensor in placement.model.tensors:
        bd = b_dim(tensor)
        b_len = tensor.shape[bd] if bd is not None else 1
        for state_class in (PARAM, OPTIM):
            boxes = holder_boxes(placement, tensor, state_class)
            keep = np.isin(boxes.rank, alive)
            if not _covers(tensor.shape[0], b_len, boxes.a0[keep], boxes.a1[keep], boxes.b0[keep], boxes.b1[keep]):
                missing.append((tensor.name, state_class))
    return missing
