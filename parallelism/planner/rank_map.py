"""Which process takes which new rank in a switch: the device-to-rank map.

A switch runs on the union world, processes 0 .. U-1 (U = the larger world): process p
holds source rank p; joining processes hold nothing. The contract's order gives
destination rank d to process d. Any bijection works as well for the engine, and one that
lets processes keep what they hold moves far less: a 405B dp=64 -> dp=48 switch keeps
every process's pipeline stage and tensor-parallel rank under the right map, but moves
most of them to another stage in the contract's order (issue 9).

The unit of a map is a block of `block` consecutive ranks (the destination's
tensor-parallel block: its ranks must share a node), aligned: destination block i goes
whole onto an aligned block of processes, its j-th rank onto the block's j-th process, so
a process keeps its tensor-parallel rank whenever its block keeps its position.

What a map saves: destination rank d on process p receives every element of its new
boxes except what p already holds (a local copy) and, for a bf16 `param`, what it casts
from the fp32 `master` it will hold (derived). Saved bytes add up over ranks, so the best
block map is a linear assignment problem, solved exactly by scipy's linear_sum_assignment
(a maintained Jonker-Volgenant solver: the dense 768 x 1,024 block matrix of a 405B
switch in a few milliseconds). Among maps that save the same, blocks that can stay in
place do (the contract's order is kept where it costs nothing).

Destination rank 0 stays on process 0 in every map: rank 0 speaks for the job (its
reports), serves the stores of its next switches and is where the control plane sends
them, so a job's rank 0 never changes process. It holds the first stage's first shards in
every layout, so this costs little: over every tiny-gpt switch among layouts of up to 4
ranks, at most 1.5 KiB (norm weights) more than the best unconstrained block map.

`network_floor`: what the destination needs minus, for every destination rank and state
tensor, the most any one process could spare it. No map of any kind (block or not) moves
less: a map gives each destination rank one process, which spares it at most that much of
each tensor. The plan reports it as min_network_bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallelism.layout.placement import Placement, tp_block
from parallelism.layout.shards import OPTIM, PARAM, STATE_CLASS, HolderBoxes, holder_boxes
from parallelism.layout.tensors import STATE_BYTES, STATES, Model, TensorSpec


def geometry(tensor: TensorSpec, src: Placement, dst: Placement) -> tuple:
    """Tensors with equal geometry have equal holder boxes in both layouts (they share a
    route in the plan)."""
    split = tensor.split
    return (tensor.shape, split.module, split.tp_dim, split.tp_units, split.ep_dim, split.place,
            src.tensor_stages(tensor), dst.tensor_stages(tensor))


def relabel(boxes: HolderBoxes, process_of: np.ndarray | None) -> HolderBoxes:
    """Destination boxes with each rank replaced by its process, sorted by process."""
    if process_of is None:
        return boxes
    procs = process_of[boxes.rank]
    order = np.argsort(procs, kind="stable")
    return HolderBoxes(procs[order], boxes.a0[order], boxes.a1[order], boxes.b0[order], boxes.b1[order],
                       unit=boxes.unit)


def _overlap(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Area of every box of p ([n, 4]) with every box of q ([m, 4]): [n, m]."""
    da = np.minimum(p[:, None, 1], q[None, :, 1]) - np.maximum(p[:, None, 0], q[None, :, 0])
    db = np.minimum(p[:, None, 3], q[None, :, 3]) - np.maximum(p[:, None, 2], q[None, :, 2])
    return np.clip(da, 0, None) * np.clip(db, 0, None)


def _intersect(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Row-wise intersection of two box arrays of equal length (empty where disjoint)."""
    out = np.stack([np.maximum(p[:, 0], q[:, 0]), np.minimum(p[:, 1], q[:, 1]),
                    np.maximum(p[:, 2], q[:, 2]), np.minimum(p[:, 3], q[:, 3])], axis=1)
    out[:, 1] = np.maximum(out[:, 1], out[:, 0])
    out[:, 3] = np.maximum(out[:, 3], out[:, 2])
    return out


@dataclass(frozen=True)
class Savings:
    """saved[d_block, p_block]: bytes the map d_block -> p_block spares the network; need:
    bytes of every destination box; best: sum over destination ranks of the most any one
    process spares it (derived bytes included); fixed: bytes derived whatever the map."""

    block: int
    saved: np.ndarray
    need: int
    best: int
    fixed: int

    @property
    def network_floor(self) -> int:
        return self.need - self.best

    def network_of(self, process_of: np.ndarray | None) -> int:
        """Bytes a map moves (None: the contract's order), from the weights alone."""
        n_dst = self.saved.shape[0]
        blocks = np.arange(n_dst) if process_of is None else process_of[::self.block] // self.block
        return self.need - self.fixed - int(round(self.saved[np.arange(n_dst), blocks].sum()))


MAX_BLOCKS = 1024  # per side of the assignment: coarser blocks beyond it (still valid maps)


def _block_size(src: Placement, dst: Placement) -> int:
    """The destination's TP block, doubled while there would be more than MAX_BLOCKS blocks
    (a dp=1024, tp=1 world is mapped in blocks of 8: 1024 x 1024, not 8192 x 8192)."""
    block = tp_block(dst)
    while dst.world // block > MAX_BLOCKS and dst.world % (2 * block) == 0:
        block *= 2
    return block


def _group_geometries(model: Model, src: Placement, dst: Placement) -> list[tuple[TensorSpec, int]]:
    """(one tensor of each geometry, how many tensors have it)."""
    first: dict[tuple, TensorSpec] = {}
    count: dict[tuple, int] = {}
    for tensor in model.tensors:
        key = geometry(tensor, src, dst)
        first.setdefault(key, tensor)
        count[key] = count.get(key, 0) + 1
    return [(first[key], count[key]) for key in first]


def _csr(groups: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Members of each group 0..n-1 as (order, ptr): members of g are order[ptr[g]:ptr[g+1]]."""
    order = np.argsort(groups, kind="stable")
    return order, np.searchsorted(groups[order], np.arange(n + 1))


def _pairs(gi: np.ndarray, gj: np.ndarray, a: tuple, b: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (member of group gi[k], member of group gj[k]) and k, for all k."""
    (a_order, a_ptr), (b_order, b_ptr) = a, b
    na, nb = a_ptr[gi + 1] - a_ptr[gi], b_ptr[gj + 1] - b_ptr[gj]
    count = na * nb
    k = np.repeat(np.arange(len(gi)), count)
    step = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
    return a_order[a_ptr[gi][k] + step // nb[k]], b_order[b_ptr[gj][k] + step % nb[k]], k


def _boxes(h: HolderBoxes) -> np.ndarray:
    return np.stack([h.a0, h.a1, h.b0, h.b1], axis=1)


def _class_bytes(state_class: str) -> int:
    return sum(STATE_BYTES[s] for s in STATES if STATE_CLASS[s] == state_class)


def _pair_gains(d_rows: np.ndarray, s_rows: np.ndarray, cache: dict):
    """For destination rows (box, part under its master) and source boxes: every
    (destination row, source row, gain) with a gain, in area units: |s ∩ box| - |s ∩ box ∩ master|. The layers of every
    pipeline stage have the same boxes (only the ranks differ): computed once (cached)."""
    key = (d_rows.shape, d_rows.tobytes(), s_rows.shape, s_rows.tobytes())
    if key not in cache:
        d_u, d_of = np.unique(d_rows, axis=0, return_inverse=True)
        s_u, s_of = np.unique(s_rows, axis=0, return_inverse=True)
        d_of, s_of = d_of.ravel(), s_of.ravel()
        gain = _overlap(d_u[:, :4], s_u) - _overlap(d_u[:, 4:], s_u)
        gi, gj = np.nonzero(gain)
        di, si, k = _pairs(gi, gj, _csr(d_of, len(d_u)), _csr(s_of, len(s_u)))
        cache[key] = (di, si, gain[gi[k], gj[k]].astype(np.float64))
    return cache[key]


def savings(model: Model, src: Placement, dst: Placement) -> Savings:
    """The block-map weights of a switch src -> dst (see the module's docstring)."""
    block = _block_size(src, dst)
    union = max(src.world, dst.world)
    n_dst, n_proc = dst.world // block, union // block
    spared = _Spared(union)  # bytes each process would spare each destination rank, all tensors
    need = fixed = 0
    cache: dict = {}
    for tensor, count in _group_geometries(model, src, dst):
        for state_class in (PARAM, OPTIM):
            s_h = holder_boxes(src, tensor, state_class)
            d_h = holder_boxes(dst, tensor, state_class)
            unit = d_h.unit * count * _class_bytes(state_class)
            need += int(((d_h.a1 - d_h.a0) * (d_h.b1 - d_h.b0)).sum()) * unit
            if not len(d_h.rank):
                continue
            d_box = _boxes(d_h)
            if state_class == PARAM:  # the part under the rank's own new master is derived anyway
                m_h = holder_boxes(dst, tensor, OPTIM)
                under = np.zeros_like(d_box)
                hit = np.searchsorted(m_h.rank, d_h.rank)
                found = hit < len(m_h.rank)
                found[found] = m_h.rank[hit[found]] == d_h.rank[found]
                under[found] = _intersect(d_box[found], _boxes(m_h)[hit[found]])
                fixed += int(((under[:, 1] - under[:, 0]) * (under[:, 3] - under[:, 2])).sum()) * unit
            else:
                under = np.zeros_like(d_box)
            if not len(s_h.rank):
                continue
            di, si, gain = _pair_gains(np.concatenate([d_box, under], axis=1), _boxes(s_h), cache)
            spared.add(d_h.rank, s_h.rank, di, si, gain * float(unit))
    d, p, total = spared.merged()
    best = np.zeros(dst.world)
    np.maximum.at(best, d, total)
    ok = (d % block == p % block) & (p // block < n_proc)  # a block's j-th rank on the j-th process
    saved = np.bincount((d[ok] // block) * n_proc + p[ok] // block, weights=total[ok],
                        minlength=n_dst * n_proc).reshape(n_dst, n_proc)
    return Savings(block, saved, need, int(round(best.sum())) + fixed, fixed)


class _Spared:
    """Bytes spared per (destination rank, process), summed over tensors. Tensors held by the
    same ranks (a pipeline stage's) add into one dense matrix over those holders; the
    matrices are merged once at the end."""

    DENSE_MAX = 4_000_000

    def __init__(self, union: int) -> None:
        self.union = union
        self.groups: dict[tuple, list] = {}
        self.loose: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []

    def add(self, d_holders: np.ndarray, s_holders: np.ndarray, di: np.ndarray, si: np.ndarray,
            gain: np.ndarray) -> None:
        if len(d_holders) * len(s_holders) > self.DENSE_MAX:
            self.loose.append((d_holders[di], s_holders[si], gain))
            return
        key = (d_holders.tobytes(), s_holders.tobytes())
        if key not in self.groups:
            self.groups[key] = [d_holders, s_holders, np.zeros((len(d_holders), len(s_holders)))]
        self.groups[key][2][di, si] += gain  # (di, si) pairs are distinct: holder rows are

    def _components(self) -> list[list]:
        """The matrices, grouped so that no two groups share a destination rank."""
        comps: list[list] = []  # [destination ranks (set), members]
        for d_holders, s_holders, dense in self.groups.values():
            ranks = set(d_holders.tolist())
            touching = [c for c in comps if not c[0].isdisjoint(ranks)]
            merged = [ranks | set().union(*(c[0] for c in touching)),
                      [(d_holders, s_holders, dense)] + [m for c in touching for m in c[1]]]
            comps = [c for c in comps if all(c is not t for t in touching)] + [merged]
        return comps

    def merged(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destination rank, process, bytes spared) of every pair that spares something,
        each pair once. The matrices of each group of destination ranks (a pipeline stage:
        its layers, its embedding) are added into one where it fits; the groups share no
        destination rank, so no pair repeats and no sort is needed."""
        parts = list(self.loose)
        distinct = not self.loose
        for ranks, members in self._components():
            if len(members) > 1:
                dst = np.asarray(sorted(ranks), dtype=np.int64)
                procs = np.unique(np.concatenate([s for _, s, _ in members]))
                if len(dst) * len(procs) <= self.DENSE_MAX:
                    combined = np.zeros((len(dst), len(procs)))
                    for d_holders, s_holders, dense in members:
                        combined[np.ix_(np.searchsorted(dst, d_holders), np.searchsorted(procs, s_holders))] += dense
                    members = [(dst, procs, combined)]
                else:
                    distinct = False
            for d_holders, s_holders, dense in members:
                i, j = np.nonzero(dense)
                parts.append((d_holders[i], s_holders[j], dense[i, j]))
        if not parts:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, np.zeros(0)
        d = np.concatenate([d for d, _, _ in parts])
        p = np.concatenate([p for _, p, _ in parts])
        g = np.concatenate([g for _, _, g in parts])
        if distinct:
            return d, p, g
        uniq, inverse = np.unique(d * self.union + p, return_inverse=True)
        return uniq // self.union, uniq % self.union, np.bincount(inverse.ravel(), weights=g)


def best_map(model: Model, src: Placement, dst: Placement) -> tuple[np.ndarray | None, Savings]:
    """(process of each destination rank, or None for the contract's order; the savings):
    the best block map that keeps destination rank 0 on process 0."""
    s = savings(model, src, dst)
    n_dst = s.saved.shape[0]
    identity = np.arange(n_dst)
    if n_dst == 0 or np.all(s.saved[identity, identity] >= s.saved.max(axis=1)):
        return None, s  # every block already has the best process block it could get
    from scipy.optimize import linear_sum_assignment  # here: 0.4 s to import, and rarely needed

    # Block 0 stays on process block 0 (rank 0 on process 0); the others among the rest.
    rows, cols = linear_sum_assignment(s.saved[1:, 1:], maximize=True)
    assign = _prefer_staying(s.saved, np.concatenate([[0], cols[np.argsort(rows)] + 1]).astype(np.int64))
    if np.array_equal(assign, identity):
        return None, s
    slot = np.arange(dst.world) % s.block
    return assign[np.arange(dst.world) // s.block] * s.block + slot, s


def _prefer_staying(saved: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """Among maps saving the same, keep destination block d on process block d: swap d's
    process block with the one d would stay on when the swap saves no less (exact: the
    weights are whole byte counts, well within float64's exact integers)."""
    assign = assign.copy()
    owner = {int(p): d for d, p in enumerate(assign)}
    for d in range(len(assign)):
        p = int(assign[d])
        if p == d or d >= saved.shape[1]:
            continue
        other = owner.get(d)  # the destination block on process block d now, if any
        now = saved[d, p] + (saved[other, d] if other is not None else 0.0)
        swapped = saved[d, d] + (saved[other, p] if other is not None else 0.0)
        if swapped >= now:
            assign[d] = d
            owner[d] = d
            if other is not None:
                assign[other] = p
                owner[p] = other
            else:
                owner.pop(p, None)
    return assign
