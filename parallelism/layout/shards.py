"""Shard maps (docs/contracts.md section 2): which box of every state tensor each rank holds.

Every box is a product of at most two intervals: axis A is dim 0 (cut by EP, by TP when
tp_dim is 0, and by ZeRO inside the TP/EP box) and axis B is the TP dim when it is not 0;
every other dim is always whole. So boxes are stored as numpy arrays (a0, a1, b0, b1),
one row per holder rank, and turned into per-dim offsets/lengths only for output.

Worked example: llama3-8b `attn.k.weight` [1024, 4096], 8 kv heads, tp=16, zero=1, dp=2:
TP ranks 2h and 2h+1 hold head h, rows [128h, 128h+128); the master copy of that box is
cut by ZeRO into 2 parts of 64 rows, part d on data-parallel rank d.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallelism.layout.placement import Placement
from parallelism.layout.tensors import TensorSpec

# State classes with identical boxes: `param`, and the optimizer's three fp32 states.
PARAM, OPTIM = "param", "optim"
STATE_CLASS = {"param": PARAM, "master": OPTIM, "exp_avg": OPTIM, "exp_avg_sq": OPTIM}


def b_dim(tensor: TensorSpec) -> int | None:
    """The dim of axis B (the TP dim when TP does not cut dim 0), or None."""
    tp_dim = tensor.split.tp_dim
    return tp_dim if tp_dim not in (None, 0) else None


def chunk(n: np.ndarray | int, parts: int, index: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
    """torch.chunk semantics: parts of ceil(n/parts), the last ones shorter or empty.
    Returns (start, stop) relative to 0. Example: n=5, parts=4 -> [0,2) [2,4) [4,5) [5,5)."""
    n = np.asarray(n, dtype=np.int64)
    size = -(-n // parts)
    start = np.minimum(np.asarray(index, dtype=np.int64) * size, n)
    return start, np.minimum(start + size, n)


def tp_interval(n: int, tp: int, units: int | None, tp_rank: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The TP rank's interval of a dim of length n: by units (heads) when given (kv heads
    fewer than tp are replicated on tp/units consecutive ranks), else torch.chunk."""
    if units is None:
        return chunk(n, tp, tp_rank)
    per_unit = n // units
    if units >= tp:
        per_rank = n // tp
        return tp_rank * per_rank, tp_rank * per_rank + per_rank
    unit = tp_rank // (tp // units)
    return unit * per_unit, unit * per_unit + per_unit


def is_sharded(state_class: str, zero: int) -> bool:
    return zero >= 3 if state_class == PARAM else zero >= 1


@dataclass(frozen=True)
class HolderBoxes:
    """The boxes of one tensor's state class in one placement (non-empty ones unless asked):
    row i is held by `rank[i]`. Rows are sorted by rank; a rank appears at most once."""

    rank: np.ndarray
    a0: np.ndarray
    a1: np.ndarray
    b0: np.ndarray
    b1: np.ndarray
    unit: int  # elements per (A, B) cell: the product of the dims that are never cut

    @property
    def size(self) -> np.ndarray:
        """Elements of each box."""
        return (self.a1 - self.a0) * (self.b1 - self.b0) * self.unit


def holder_boxes(placement: Placement, tensor: TensorSpec, state_class: str, *,
                 keep_empty: bool = False, only_rank: int | None = None) -> HolderBoxes:
    """Every holder's box; zero-size ones (torch.chunk's empty last parts, e.g. a 1-row
    tensor's ZeRO chunks on dp ranks >= 1) are left out, as docs/contracts.md section 3 says, unless
    `keep_empty`: a trainer still builds an empty tensor there (parallelism/engine/shards.py).
    With `only_rank`, that rank's box alone (none if it holds no part): the same arithmetic
    on one grid point instead of all dp x cp x tp of them (a 405B stage at dp=64 has 512)."""
    ml = placement.modules[tensor.split.module]
    split, shape = tensor.split, tensor.shape
    stages = np.array(placement.tensor_stages(tensor), dtype=np.int64)
    data = ml.dp * ml.cp
    if only_rank is None:
        stage, d, tp_rank = (g.ravel() for g in np.meshgrid(stages, np.arange(data), np.arange(ml.tp), indexing="ij"))
    else:
        stage, d, tp_rank = _rank_coordinates(only_rank - ml.offset, ml.tp, data, ml.pp, stages)
    rank = ml.offset + stage * (ml.tp * data) + tp_rank + ml.tp * d

    # Axis A (dim 0): EP for expert tensors, TP when it splits dim 0, else whole.
    if split.ep_dim is not None:
        per = shape[0] // ml.ep
        a0 = (d % ml.ep) * per
        a1 = a0 + per
    elif split.tp_dim == 0:
        a0, a1 = tp_interval(shape[0], ml.tp, split.tp_units, tp_rank)
    else:
        a0, a1 = np.zeros_like(rank), np.full_like(rank, shape[0])
    bd = b_dim(tensor)
    if bd is None:
        b0, b1 = np.zeros_like(rank), np.ones_like(rank)
    else:
        b0, b1 = tp_interval(shape[bd], ml.tp, split.tp_units, tp_rank)
    if is_sharded(state_class, ml.zero):
        parts = data // ml.ep if split.ep_dim is not None else data
        part = d // ml.ep if split.ep_dim is not None else d
        start, stop = chunk(a1 - a0, parts, part)
        a0, a1 = a0 + start, a0 + stop
    keep = np.ones_like(rank, dtype=bool) if keep_empty else (a1 > a0) & (b1 > b0)
    order = np.argsort(rank[keep], kind="stable")
    return HolderBoxes(*(np.ascontiguousarray(x[keep][order]) for x in (rank, a0, a1, b0, b1)),
                       unit=cell_elements(tensor))


def _rank_coordinates(local: int, tp: int, data: int, pp: int, stages: np.ndarray):
    """(stage, data index, tp rank) of a module-local rank as one-element arrays, all three
    empty when the rank is outside the module or on a stage not holding the tensor (the
    inverse of holder_boxes' rank = offset + stage * tp * data + tp_rank + tp * d)."""
    stage, rest = divmod(local, tp * data)
    if local < 0 or stage >= pp or stage not in stages:
        return (np.zeros(0, dtype=np.int64),) * 3
    return tuple(np.array([v], dtype=np.int64) for v in (stage, rest // tp, rest % tp))


def cell_elements(tensor: TensorSpec) -> int:
    """Elements per unit of A x B: the product of the dims other than 0 and the B dim."""
    bd = b_dim(tensor)
    return int(np.prod([n for i, n in enumerate(tensor.shape) if i not in (0, bd)], dtype=np.int64))


def full_box(tensor: TensorSpec, a0: int, a1: int, b0: int, b1: int) -> tuple[list[int], list[int]]:
    """Per-dim (offsets, lengths) in global coordinates of an (A, B) box."""
    offsets = [0] * len(tensor.shape)
    lengths = list(tensor.shape)
    offsets[0], lengths[0] = int(a0), int(a1 - a0)
    bd = b_dim(tensor)
    if bd is not None:
        offsets[bd], lengths[bd] = int(b0), int(b1 - b0)
    return offsets, lengths
