"""Routing one tensor's state class from a source to a destination layout.

For every destination rank and its box: what it already holds (local copy), what it can
compute (a bf16 `param` cast from the fp32 `master` it will hold: derived), and for the
rest one direct transfer per source cell from one holder (one hop, never gathered
first). Among replicas the holder is chosen on the destination's node when one is there,
and otherwise spread round-robin so that no replica (e.g. DP rank 0) becomes a hot spot.

Everything is vectorized over ranks with numpy: a 8,192-rank world is a few thousand rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from parallelism.layout.shards import HolderBoxes

I64 = np.int64


@dataclass(frozen=True)
class Pieces:
    """Boxes owned by ranks: rows (rank, a0, a1, b0, b1)."""

    rank: np.ndarray
    a0: np.ndarray
    a1: np.ndarray
    b0: np.ndarray
    b1: np.ndarray

    @classmethod
    def empty(cls) -> Pieces:
        z = np.zeros(0, dtype=I64)
        return cls(z, z, z, z, z)

    @classmethod
    def concat(cls, parts: list[Pieces]) -> Pieces:
        parts = [p for p in parts if len(p.rank)]
        if not parts:
            return cls.empty()
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("rank", "a0", "a1", "b0", "b1")))

    def nonempty(self) -> Pieces:
        keep = (self.a1 > self.a0) & (self.b1 > self.b0)
        return Pieces(self.rank[keep], self.a0[keep], self.a1[keep], self.b0[keep], self.b1[keep])

    @property
    def size(self) -> np.ndarray:
        return (self.a1 - self.a0) * (self.b1 - self.b0)

    def __len__(self) -> int:
        return len(self.rank)


@dataclass(frozen=True)
class Route:
    """The outcome for one (tensor, state class): transfers src -> dst of boxes, local
    copies and derived boxes. Boxes are (A, B) areas; `unit` elements per area unit."""

    src: np.ndarray
    dst: np.ndarray
    boxes: Pieces  # boxes.rank == dst
    local: Pieces
    derived: Pieces
    need_elems: int
    src_holders: HolderBoxes  # the source boxes
    dst_holders: HolderBoxes  # the destination boxes
    unit: int

    def elements(self, pieces: Pieces) -> np.ndarray:
        return pieces.size * self.unit

    @property
    def transfer_elems(self) -> int:
        return int(self.elements(self.boxes).sum())

    @cached_property
    def kept(self) -> np.ndarray:
        """Ranks whose box is the same in both layouts: they keep the tensor as it is (no
        copy, no new memory), so the memory wave neither frees nor allocates it."""
        loc = self.local
        if not len(loc):
            return loc.rank
        size = self.elements(loc)
        src, dst = self.src_holders, self.dst_holders  # a local piece's rank holds both boxes
        same = (size == src.size[np.searchsorted(src.rank, loc.rank)]) & (
            size == dst.size[np.searchsorted(dst.rank, loc.rank)])
        return loc.rank[same]

    def copying(self, a_lo: int, a_hi: int) -> np.ndarray:
        """Ranks (not keeping their box) with a local copy of some row in [a_lo, a_hi)."""
        loc = self.local
        rows = (np.minimum(loc.a1, a_hi) > np.maximum(loc.a0, a_lo)) & ~np.isin(loc.rank, self.kept)
        return loc.rank[rows]


def _lookup(holders: HolderBoxes, ranks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Row index of each rank in `holders` and whether it is there."""
    idx = np.searchsorted(holders.rank, ranks)
    idx_c = np.minimum(idx, max(len(holders.rank) - 1, 0))
    found = (idx < len(holders.rank)) & (holders.rank[idx_c] == ranks) if len(holders.rank) else np.zeros(len(ranks), bool)
    return idx_c, found


def _subtract(p: Pieces, c0: np.ndarray, c1: np.ndarray, d0: np.ndarray, d1: np.ndarray, mask: np.ndarray) -> Pieces:
    """p minus the box [c0,c1) x [d0,d1) on rows where mask (the box lies inside p)."""
    keep = Pieces(p.rank[~mask], p.a0[~mask], p.a1[~mask], p.b0[~mask], p.b1[~mask])
    r, a0, a1, b0, b1 = (x[mask] for x in (p.rank, p.a0, p.a1, p.b0, p.b1))
    c0, c1, d0, d1 = c0[mask], c1[mask], d0[mask], d1[mask]
    return Pieces.concat([
        keep,
        Pieces(r, a0, c0, b0, b1).nonempty(),       # rows before the box
        Pieces(r, c1, a1, b0, b1).nonempty(),       # rows after
        Pieces(r, c0, c1, b0, d0).nonempty(),       # beside, left
        Pieces(r, c0, c1, d1, b1).nonempty(),       # beside, right
    ])


def _intersect(p: Pieces, h: HolderBoxes, idx: np.ndarray, found: np.ndarray):
    a0 = np.maximum(p.a0, h.a0[idx]); a1 = np.minimum(p.a1, h.a1[idx])
    b0 = np.maximum(p.b0, h.b0[idx]); b1 = np.minimum(p.b1, h.b1[idx])
    mask = found & (a1 > a0) & (b1 > b0)
    return a0, a1, b0, b1, mask


def _cells(src: HolderBoxes):
    """The source partition's cells (a grid of the cut points) and, per cell, its holders
    sorted by rank, as CSR: holders[ptr[c]:ptr[c+1]]."""
    acuts = np.unique(np.concatenate([src.a0, src.a1]))
    bcuts = np.unique(np.concatenate([src.b0, src.b1]))
    ia0, ia1 = np.searchsorted(acuts, src.a0), np.searchsorted(acuts, src.a1)
    ib0, ib1 = np.searchsorted(bcuts, src.b0), np.searchsorted(bcuts, src.b1)
    nb = len(bcuts) - 1
    na_span, nb_span = ia1 - ia0, ib1 - ib0
    count = na_span * nb_span
    row = np.repeat(np.arange(len(src.rank)), count)
    k = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    cell = (ia0[row] + k // nb_span[row]) * nb + (ib0[row] + k % nb_span[row])
    order = np.lexsort((src.rank[row], cell))
    cell, holder = cell[order], src.rank[row][order]
    ptr = np.searchsorted(cell, np.arange((len(acuts) - 1) * nb + 1))
    return acuts, bcuts, cell, holder, ptr


def _expand_over_cells(p: Pieces, acuts: np.ndarray, bcuts: np.ndarray):
    """Every (piece, source cell) overlap, clipped."""
    ia0 = np.searchsorted(acuts, p.a0, side="right") - 1
    ia1 = np.searchsorted(acuts, p.a1, side="left")
    ib0 = np.searchsorted(bcuts, p.b0, side="right") - 1
    ib1 = np.searchsorted(bcuts, p.b1, side="left")
    na, nbs = ia1 - ia0, ib1 - ib0
    count = na * nbs
    row = np.repeat(np.arange(len(p)), count)
    k = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    ia = ia0[row] + k // nbs[row]
    ib = ib0[row] + k % nbs[row]
    a0 = np.maximum(p.a0[row], acuts[ia]); a1 = np.minimum(p.a1[row], acuts[ia + 1])
    b0 = np.maximum(p.b0[row], bcuts[ib]); b1 = np.minimum(p.b1[row], bcuts[ib + 1])
    return Pieces(p.rank[row], a0, a1, b0, b1), ia * (len(bcuts) - 1) + ib


def _occurrence(keys: np.ndarray) -> np.ndarray:
    """For each element, how many earlier elements share its key (0, 1, 2, ...)."""
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    start = np.r_[0, np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1]
    run_start = np.repeat(start, np.diff(np.r_[start, len(keys)]))
    occ = np.empty(len(keys), dtype=I64)
    occ[order] = np.arange(len(keys)) - run_start
    return occ


def _choose(dst: np.ndarray, cell: np.ndarray, holder: np.ndarray, holder_cell: np.ndarray, ptr: np.ndarray,
            gpus_per_node: int, salt: int, world: int) -> np.ndarray:
    """One holder per need: same node as the destination when possible, else round-robin
    over all replicas (rotated per cell and per tensor so low ranks are not favoured)."""
    lo, hi = ptr[cell], ptr[cell + 1]
    if np.any(hi <= lo):
        raise AssertionError("a destination need has no source holder")  # layouts always cover a tensor
    node = dst // gpus_per_node
    key = holder_cell * (world + gpus_per_node) + holder
    nlo = np.searchsorted(key, cell * (world + gpus_per_node) + node * gpus_per_node)
    nhi = np.searchsorted(key, cell * (world + gpus_per_node) + (node + 1) * gpus_per_node)
    same = nhi > nlo
    occ_same = _occurrence(cell * (world // gpus_per_node + 1) + node)
    occ_any = _occurrence(cell)
    pick_same = nlo + (occ_same + salt) % np.maximum(nhi - nlo, 1)
    pick_any = lo + (occ_any + salt + cell) % (hi - lo)
    return holder[np.where(same, pick_same, pick_any)]


def route(src: HolderBoxes, dst: HolderBoxes, dst_master: HolderBoxes | None, *, gpus_per_node: int,
          salt: int = 0) -> Route:
    """Plan one (tensor, state class); `dst_master` given for `param` to derive from it."""
    need = Pieces(dst.rank, dst.a0, dst.a1, dst.b0, dst.b1)
    world = int(max(src.rank.max(initial=0), dst.rank.max(initial=0))) + 1
    idx, found = _lookup(src, need.rank)
    a0, a1, b0, b1, mask = _intersect(need, src, idx, found)
    local = Pieces(need.rank[mask], a0[mask], a1[mask], b0[mask], b1[mask])
    rest = _subtract(need, a0, a1, b0, b1, mask)

    derived = Pieces.empty()
    if dst_master is not None and len(rest):
        midx, mfound = _lookup(dst_master, rest.rank)
        c0, c1, d0, d1, mmask = _intersect(rest, dst_master, midx, mfound)
        derived = Pieces(rest.rank[mmask], c0[mmask], c1[mmask], d0[mmask], d1[mmask])
        rest = _subtract(rest, c0, c1, d0, d1, mmask)

    if len(rest):
        acuts, bcuts, holder_cell, holder, ptr = _cells(src)
        boxes, cell = _expand_over_cells(rest, acuts, bcuts)  # every overlap is non-empty
        sender = _choose(boxes.rank, cell, holder, holder_cell, ptr, gpus_per_node, salt, world)
    else:
        boxes, sender = Pieces.empty(), np.zeros(0, dtype=I64)
    order = np.lexsort((boxes.a0, boxes.b0, boxes.rank, sender)) if len(sender) else np.zeros(0, dtype=I64)
    boxes = Pieces(*(getattr(boxes, f)[order] for f in ("rank", "a0", "a1", "b0", "b1")))
    return Route(src=sender[order], dst=boxes.rank, boxes=boxes, local=local, derived=derived,
                 need_elems=int(dst.size.sum()), src_holders=src, dst_holders=dst,
                 unit=dst.unit)
