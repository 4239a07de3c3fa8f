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

from parallelism.layout.errors import LayoutError
from parallelism.planner.routing import Route
from parallelism.layout.shards import chunk


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


def _staging(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
             copying: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Ranks touched and the bytes each stages (send + receive); ranks that only copy
    locally (`copying`) are touched with 0 bytes."""
    copying = np.zeros(0, dtype=np.int64) if copying is None else copying
    ranks = np.concatenate([src, dst, copying])
    weights = np.concatenate([nbytes, nbytes, np.zeros(len(copying))]).astype(np.float64)
    uniq, inv = np.unique(ranks, return_inverse=True)
    return uniq, np.bincount(inv, weights=weights)


def cut_rounds(routes: list[Route], item_bytes: list[int], dim0: list[int], budget: int, world: int) -> list[list[Slice]]:
    """Place items (or their slices) into rounds, in item order, each at the first round,
    from the latest round any of its ranks already uses, where every one of its ranks
    still has room in the budget. Each rank so works through its items in the global
    order, while ranks that share nothing (e.g. different pipeline stages) fill the same
    rounds in parallel instead of waiting for each other. A rank that only copies locally
    in a slice counts as one of its ranks (with 0 bytes), so that it too meets its items
    in the global order (what memory_wave's bound relies on)."""
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
            staging_cache[key] = _staging(route.src, route.dst, route.elements(route.boxes),
                                          route.copying(0, dim0[i]))
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
    further by transfers, in route order. A row slice with local copies but no transfer
    is kept (the engine copies a slice's rows locally only in its slices)."""
    parts = 2
    while True:
        slices = []
        for p in range(parts):
            lo, hi = (int(x) for x in chunk(n0, parts, p))
            if hi <= lo:
                continue
            src, dst, elems = _clip(route, lo, hi)
            copying = route.copying(lo, hi)
            if len(src) == 0 and len(copying) == 0:
                continue
            ranks, staged = _staging(src, dst, elems, copying)
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
        ranks, staged = _staging(src, dst, el, route.copying(lo, hi) if t_lo == 0 else None)
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
_NONE: Sparse = (np.zeros(0, dtype=np.int64), np.zeros(0))


@dataclass(frozen=True)
class SliceMemory:
    """What one slice (rows [a_lo, a_hi) of one item) does to each rank's state memory.
    Shards are whole tensors: a rank allocates its destination box in the round of the
    first slice that writes into it: before the exchange when it receives a piece of it in
    that round (the engine lets pieces land in place; `ready`), else at its local copy
    (`alloc`). It frees its source box in the last slice that reads it: once packed
    (`early`) or, when a local copy reads it in that round or later, after that copy
    (`late`). Boxes a rank keeps unchanged appear in none."""

    early: Sparse
    late: Sparse
    alloc: Sparse
    ready: Sparse = _NONE


@dataclass(frozen=True)
class _Touches:
    """For one route and one list of slices: per source holder (not keeping its box) the
    last slice that sends from it and the last that copies from it locally, per
    destination holder the first slice that writes into it (receives or copies) and the
    first in which it receives; -1 for none."""

    src_rank: np.ndarray
    src_elems: np.ndarray
    last_send: np.ndarray
    last_local: np.ndarray
    dst_rank: np.ndarray
    dst_elems: np.ndarray
    first_write: np.ndarray
    first_recv: np.ndarray
    first_copy: np.ndarray


def _touches(route: Route, slices: list[Slice]) -> _Touches:
    src, dst = route.src_holders, route.dst_holders
    last_send = np.full(len(src.rank), -1)
    last_local = np.full(len(src.rank), -1)
    first_write = np.full(len(dst.rank), -1)
    first_recv = np.full(len(dst.rank), -1)
    first_copy = np.full(len(dst.rank), -1)
    for t in range(len(slices) - 1, -1, -1):  # backwards: the first write is assigned last
        sl = slices[t]
        senders, receivers, _ = _clip(route, sl.a_lo, sl.a_hi, sl.t_lo, sl.t_hi)
        copying = route.copying(sl.a_lo, sl.a_hi) if sl.t_lo == 0 else np.zeros(0, dtype=np.int64)
        first_write[np.searchsorted(dst.rank, np.concatenate([receivers, copying]))] = t
        first_recv[np.searchsorted(dst.rank, receivers)] = t
        first_copy[np.searchsorted(dst.rank, copying)] = t
        for last, ranks in ((last_send, senders), (last_local, copying)):
            hit = np.searchsorted(src.rank, ranks)
            last[hit[last[hit] < 0]] = t
    moving_src, moving_dst = ~np.isin(src.rank, route.kept), ~np.isin(dst.rank, route.kept)
    return _Touches(src.rank[moving_src], src.size[moving_src], last_send[moving_src], last_local[moving_src],
                    dst.rank[moving_dst], dst.size[moving_dst], first_write[moving_dst], first_recv[moving_dst],
                    first_copy[moving_dst])


def _effects(tc: _Touches, round_of: list[int], nbytes: float) -> tuple[list[SliceMemory], Sparse, Sparse]:
    """One item's SliceMemory per slice (slices in rounds `round_of`), and what its ranks
    free before the first round / allocate after the last."""
    rnd = np.array([*round_of, -1])  # index -1: no such slice
    src_bytes, dst_bytes = tc.src_elems * nbytes, tc.dst_elems * nbytes
    never = (tc.last_send < 0) & (tc.last_local < 0)
    early = ~never & ((tc.last_local < 0) | (rnd[tc.last_local] < rnd[tc.last_send]))
    late = ~never & ~early
    blank = tc.first_write < 0
    # The engine runs a round's local copies before its exchange: a box first written in a
    # round where it gets a local copy is allocated at that copy (`alloc`, in the copy's
    # slice); otherwise it receives in that round and is allocated before the exchange (`ready`).
    copied_first = ~blank & (tc.first_copy >= 0) & (rnd[tc.first_copy] == rnd[tc.first_write])
    ready = ~blank & ~copied_first
    per_slice = []

    def part(ranks: np.ndarray, nbytes: np.ndarray, mask: np.ndarray) -> Sparse:
        return (ranks[mask], nbytes[mask]) if mask.any() else _NONE

    for t in range(len(round_of)):
        written = tc.first_write == t
        per_slice.append(SliceMemory(early=part(tc.src_rank, src_bytes, early & (tc.last_send == t)),
                                     late=part(tc.src_rank, src_bytes, late & (tc.last_local == t)),
                                     alloc=part(tc.dst_rank, dst_bytes, copied_first & (tc.first_copy == t)),
                                     ready=part(tc.dst_rank, dst_bytes, written & ready)))
    return per_slice, (tc.src_rank[never], src_bytes[never]), (tc.dst_rank[blank], dst_bytes[blank])


def slice_memory(rounds: list[list[Slice]], routes: list[Route], item_bytes: list[int],
                 world: int) -> tuple[dict[tuple, SliceMemory], np.ndarray, np.ndarray]:
    """Every slice's SliceMemory, as parallelism/engine/execute.py frees and allocates, rank by
    rank; plus the bytes each rank frees before the first round (source boxes it never
    reads) and allocates after the last (destination boxes only derived, e.g. a bf16
    `param` cast from the new `master`)."""
    placed: dict[int, list[tuple[int, Slice]]] = {}
    for k, round_slices in enumerate(rounds):
        for sl in round_slices:
            placed.setdefault(sl.item, []).append((k, sl))
    effects: dict[tuple, SliceMemory] = {}
    unread: list[Sparse] = []
    unwritten: list[Sparse] = []
    touches: dict[tuple, _Touches] = {}
    done: dict[tuple, tuple[list[SliceMemory], Sparse, Sparse]] = {}
    for item, where in placed.items():
        route, nbytes = routes[item], item_bytes[item]
        slices = [sl for _, sl in where]
        cuts = (id(route), tuple((sl.a_lo, sl.a_hi, sl.t_lo, sl.t_hi) for sl in slices))
        # Routes and their slicing are shared by layers and by the fp32 states; only which
        # of an item's slices share a round decides between an early and a late free.
        key = (*cuts, nbytes, tuple(k - where[0][0] for k, _ in where))
        if key not in done:
            if cuts not in touches:
                touches[cuts] = _touches(route, slices)
            done[key] = _effects(touches[cuts], [k for k, _ in where], float(nbytes))
        per_slice, never_read, never_written = done[key]
        for sl, effect in zip(slices, per_slice):
            effects[sl.key] = effect
        unread.append(never_read)
        unwritten.append(never_written)

    def total(parts: list[Sparse]) -> np.ndarray:
        if not parts:
            return np.zeros(world)
        return np.bincount(np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts]),
                           minlength=world).astype(np.float64)

    return effects, total(unread), total(unwritten)


def memory_wave(rounds: list[list[Slice]], start: np.ndarray, effects: dict[tuple, SliceMemory],
                stats: RoundStats, world: int, never_read: np.ndarray | None = None,
                never_written: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Predicted state bytes on every rank after each round, and the peak within it.

    Mirrors parallelism/engine/execute.py. Source boxes never read are freed before the first
    round (counted in round 0's pack). Within a round: pack (send staging allocated, early
    sources freed) -> local copies slice by slice in the global order (a destination box
    allocated at its first copy, a source freed after its last) -> the other destination
    boxes written in the round allocated, receive staging -> exchange -> unpack ->
    staging freed.
    Destination boxes nobody writes (derived only) are allocated at the end (counted in
    the last round, with its staging: an upper bound).

    Bound (tested as a property): a rank meets its items in the global order (cut_rounds),
    holds a box past its item only while that item's slices last, and within a round frees
    what it packs before allocating, and frees the sources of its local copies before the
    round's receiving boxes are allocated. So its peak is at most the order's
    one-item-at-a-time peak (each item's new box allocated before its old box is freed) +
    the staging it uses in a round (<= the budget) (+ the source bytes it copies locally
    within one round, the term the tests still allow).
    Returns (after[rounds + 1, world], peak[rounds, world]).
    """
    def add(out: np.ndarray, sparse: Sparse, sign: float = 1.0) -> None:
        ranks, nbytes = sparse
        if len(ranks):
            out[ranks] += sign * nbytes  # a rank appears once in a slice's effect

    mem = start.astype(np.float64).copy()
    after, peaks = [mem.copy()], []
    for k, round_slices in enumerate(rounds):
        early = np.zeros(world) if k or never_read is None else never_read.astype(np.float64).copy()
        ready = np.zeros(world)
        for s in round_slices:
            add(early, effects[s.key].early)
            add(ready, effects[s.key].ready)
        local, local_peak = np.zeros(world), np.zeros(world)  # the local-copy phase, before the exchange
        for s in round_slices:
            effect = effects[s.key]
            add(local, effect.alloc)
            np.maximum(local_peak, local, out=local_peak)
            add(local, effect.late, -1.0)
        send = stats.send_intra[k] + stats.send_inter[k]
        recv = stats.recv_intra[k] + stats.recv_inter[k]
        exchange = mem - early + send + local + ready + recv
        if k == len(rounds) - 1 and never_written is not None:
            exchange = exchange + never_written
            ready = ready + never_written
        peaks.append(np.maximum.reduce([mem + send, mem - early + send + local_peak, exchange]))
        mem = mem - early + local + ready
        after.append(mem.copy())
    return np.array(after), np.array(peaks)
