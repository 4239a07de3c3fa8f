"""Rounds: the transfers placed, in the global tensor order, into rounds in which no rank
stages more than the budget (bytes it packs to send plus bytes it receives). Every rank
computes the same placement, so each message sits in the same round for its sender and
its receiver: a round's batched sends and receives always pair up (no deadlock).

An item (one tensor's one state) that alone exceeds the budget is cut along dim 0 into
equal slices (the same global cut points for all ranks) until every slice fits.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agents.layout.errors import LayoutError
from agents.layout.routing import Route
from agents.layout.shards import chunk


@dataclass(frozen=True)
class Slice:
    """Rows [a_lo, a_hi) of one item's transfers [t_lo, t_hi) (route order), in one round.
    The transfer range only narrows when a single row is too big for the budget (a row
    sent to many peers); local copies of the rows happen in the slice with t_lo == 0."""

    item: int
    a_lo: int
    a_hi: int
    t_lo: int = 0
    t_hi: int | None = None

    @property
    def key(self) -> tuple[int, int, int, int]:
        return (self.item, self.a_lo, self.a_hi, self.t_lo)

    def transfers(self, route: Route) -> np.ndarray:
        """Indices of the route's transfers this slice carries (before row clipping)."""
        return np.arange(self.t_lo, len(route.src) if self.t_hi is None else self.t_hi)


def _clip(route: Route, a_lo: int, a_hi: int, t_lo: int = 0, t_hi: int | None = None):
    """(src, dst, elements) of the item's transfers [t_lo, t_hi) within rows [a_lo, a_hi)."""
    b = route.boxes
    sel = slice(t_lo, t_hi)
    a0, a1 = np.maximum(b.a0[sel], a_lo), np.minimum(b.a1[sel], a_hi)
    elems = np.maximum(a1 - a0, 0) * (b.b1[sel] - b.b0[sel]) * route.unit
    keep = elems > 0
    return route.src[sel][keep], route.dst[sel][keep], elems[keep]


def _staging(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranks touched and the bytes each stages (send + receive)."""
    ranks = np.concatenate([src, dst])
    weights = np.concatenate([nbytes, nbytes]).astype(np.float64)
    uniq, inv = np.unique(ranks, return_inverse=True)
    return uniq, np.bincount(inv, weights=weights)


def cut_rounds(routes: list[Route], item_bytes: list[int], dim0: list[int], budget: int, world: int) -> list[list[Slice]]:
    """Place items (or their slices) into rounds, in item order, each at the first round,
    from the latest round any of its ranks already uses, where every one of its ranks
    still has room in the budget. Each rank so works through its items in the global
    order, while ranks that share nothing (e.g. different pipeline stages) fill the same
    rounds in parallel instead of waiting for each other."""
    loads: list[np.ndarray] = []
    rounds: list[list[Slice]] = []
    cursor = np.zeros(world, dtype=np.int64)  # per rank: the latest round it is in
    staging_cache: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    split_cache: dict[tuple, list] = {}

    def place(ranks: np.ndarray, nbytes: np.ndarray, piece: Slice) -> None:
        k = int(cursor[ranks].max(initial=0))
        while True:
            if k == len(rounds):
                rounds.append([])
                loads.append(np.zeros(world))
            if len(nbytes) == 0 or (loads[k][ranks] + nbytes).max() <= budget:
                break
            k += 1
        loads[k][ranks] += nbytes
        rounds[k].append(piece)
        cursor[ranks] = k

    for i, (route, nbytes) in enumerate(zip(routes, item_bytes)):
        if len(route.src) == 0:  # local copies / derived only: with the rest of its ranks' work
            ranks = np.union1d(route.src_holders.rank, route.dst_holders.rank)
            place(ranks, np.zeros(len(ranks)), Slice(i, 0, dim0[i]))
            continue
        key = id(route)
        if key not in staging_cache:
            staging_cache[key] = _staging(route.src, route.dst, route.elements(route.boxes))
        ranks, elems = staging_cache[key]
        slices = [(0, dim0[i], 0, None, ranks, elems * nbytes)]
        if (elems * nbytes).max() > budget:
            split_key = (key, nbytes, dim0[i])  # routes are shared by layers and by the 3 fp32 states
            if split_key not in split_cache:
                split_cache[split_key] = _split(route, nbytes, dim0[i], budget)
            slices = split_cache[split_key]
        for a_lo, a_hi, t_lo, t_hi, ranks_s, bytes_s in slices:
            place(ranks_s, bytes_s, Slice(i, a_lo, a_hi, t_lo, t_hi))
    return rounds or [[]]


def _split(route: Route, nbytes: int, n0: int, budget: int):
    """Equal row slices (the same global cut points on every rank), doubling their number
    until each fits; rows that cannot fit alone (one row sent to many peers) are cut
    further by transfers, in route order."""
    parts = 2
    while True:
        slices = []
        for p in range(parts):
            lo, hi = (int(x) for x in chunk(n0, parts, p))
            if hi <= lo:
                continue
            src, dst, elems = _clip(route, lo, hi)
            if len(src) == 0:
                continue
            ranks, staged = _staging(src, dst, elems)
            slices.append((lo, hi, 0, None, ranks, staged * nbytes))
        if all(s[5].max() <= budget for s in slices):
            return slices
        if parts >= n0:
            return [piece for s in slices for piece in
                    ([s] if s[5].max() <= budget else _split_transfers(route, nbytes, s[0], s[1], budget))]
        parts = min(parts * 2, n0)


def _split_transfers(route: Route, nbytes: int, lo: int, hi: int, budget: int):
    """Rows [lo, hi) cut into runs of consecutive transfers that each fit the budget."""
    b = route.boxes
    elems = np.maximum(np.minimum(b.a1, hi) - np.maximum(b.a0, lo), 0) * (b.b1 - b.b0) * route.unit * nbytes
    pieces, start, load = [], 0, {}
    for t in range(len(route.src)):
        if elems[t] == 0:
            continue
        if elems[t] * (2 if route.src[t] == route.dst[t] else 1) > budget:
            raise LayoutError(f"staging budget {budget} B is smaller than one row of one transfer "
                              f"({elems[t]} B); raise --staging-mb")
        s, d = int(route.src[t]), int(route.dst[t])
        if load.get(s, 0) + elems[t] > budget or load.get(d, 0) + elems[t] > budget:
            pieces.append((start, t))
            start, load = t, {}
        load[s] = load.get(s, 0) + elems[t]
        load[d] = load.get(d, 0) + elems[t]
    pieces.append((start, len(route.src)))
    out = []
    for t_lo, t_hi in pieces:
        src, dst, el = _clip(route, lo, hi, t_lo, t_hi)
        ranks, staged = _staging(src, dst, el) if len(src) else (np.zeros(0, np.int64), np.zeros(0))
        out.append((lo, hi, t_lo, t_hi, ranks, staged * nbytes))
    return out


@dataclass(frozen=True)
class RoundStats:
    """Per round and rank: bytes sent/received (split same-node / other-node) and peers."""

    send_intra: np.ndarray  # [rounds, world]
    send_inter: np.ndarray
    recv_intra: np.ndarray
    recv_inter: np.ndarray
    messages: np.ndarray    # [rounds, world]: distinct peers (sends + receives)
    transfers: int


def round_stats(rounds: list[list[Slice]], routes: list[Route], item_bytes: list[int], world: int,
                gpus_per_node: int) -> RoundStats:
    shape = (len(rounds), world)
    send_intra, send_inter, recv_intra, recv_inter, messages = (np.zeros(shape) for _ in range(5))
    transfers = 0
    for k, round_slices in enumerate(rounds):
        parts = [_clip(routes[s.item], s.a_lo, s.a_hi, s.t_lo, s.t_hi) + (item_bytes[s.item],)
                 for s in round_slices if len(routes[s.item].src)]
        if not parts:
            continue
        src = np.concatenate([p[0] for p in parts])
        dst = np.concatenate([p[1] for p in parts])
        nbytes = np.concatenate([p[2] * p[3] for p in parts]).astype(np.float64)
        transfers += len(src)
        same = (src // gpus_per_node) == (dst // gpus_per_node)
        send_intra[k] = np.bincount(src[same], nbytes[same], minlength=world)
        send_inter[k] = np.bincount(src[~same], nbytes[~same], minlength=world)
        recv_intra[k] = np.bincount(dst[same], nbytes[same], minlength=world)
        recv_inter[k] = np.bincount(dst[~same], nbytes[~same], minlength=world)
        pairs = np.unique(src * world + dst)
        messages[k] = np.bincount(pairs // world, minlength=world) + np.bincount(pairs % world, minlength=world)
    return RoundStats(send_intra, send_inter, recv_intra, recv_inter, messages, transfers)


Sparse = tuple[np.ndarray, np.ndarray]  # (ranks, bytes)


@dataclass(frozen=True)
class SliceMemory:
    """What one slice (rows [a_lo, a_hi) of one item) does to each rank's state memory.
    Shards are whole tensors: the item's first slice allocates the destination boxes, its
    last frees the source boxes, once packed (`early`) or after the round's local copies
    (`late`). Boxes a rank keeps unchanged appear in none."""

    early: Sparse
    late: Sparse
    alloc: Sparse


def memory_wave(rounds: list[list[Slice]], start: np.ndarray, effects: dict[tuple, SliceMemory],
                stats: RoundStats, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Predicted state bytes on every rank after each round, and the peak within it.

    Mirrors agents/engine/execute.py. Within a round: pack (send staging allocated, early sources freed) -> exchange (receive
    staging) -> slice by slice in the global order: allocate destination boxes, copy the
    local part and unpack, free the late sources -> staging freed.
    Returns (after[rounds + 1, world], peak[rounds, world]).
    """
    def add(out: np.ndarray, sparse: Sparse, sign: float = 1.0) -> None:
        ranks, nbytes = sparse
        if len(ranks):
            np.add.at(out, ranks, sign * nbytes)

    mem = start.astype(np.float64).copy()
    after, peaks = [mem.copy()], []
    for k, round_slices in enumerate(rounds):
        early = np.zeros(world)
        running, running_peak = np.zeros(world), np.zeros(world)
        for s in round_slices:
            add(early, effects[s.key].early)
        for s in round_slices:
            effect = effects[s.key]
            add(running, effect.alloc)
            np.maximum(running_peak, running, out=running_peak)
            add(running, effect.late, -1.0)
        send = stats.send_intra[k] + stats.send_inter[k]
        recv = stats.recv_intra[k] + stats.recv_inter[k]
        peaks.append(np.maximum(mem + send, mem - early + send + recv + running_peak))
        mem = mem - early + running
        after.append(mem.copy())
    return np.array(after), np.array(peaks)
