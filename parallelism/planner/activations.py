"""Activations as logical tensors with a layout: the boundary between two modules' layouts.

An activation [batch, tokens, hidden] crossing from one module to the next (the encoder's
image tokens into the LLM) is held, on the holding pipeline stage of a module layout, as:
batch cut over the module's dp (torch.chunk semantics, so uneven batches give the last
ranks fewer or no samples), tokens cut over cp (torch.chunk), replicated over tp, hidden
whole. The rank of a box follows docs/contracts.md section 1:
`offset + tp_rank + tp*(cp_rank + cp*(dp_rank + dp*stage))`.

These are the same (A, B) boxes as the state planner's (parallelism/layout/shards.py) with
A = batch and B = tokens, so the boundary's plan is `routing.route` from the sending
layout's boxes to the receiving layout's: local copies where a rank holds both, one
direct transfer per remaining piece otherwise. The backward plan is the same call with
the two layouts swapped: gradients of a replicated activation are themselves replicated,
so any holder can return them.

Worked example: batch 5, encoder dp=4 (rows [0,2) [2,4) [4,5) on ranks 0-2, none on
rank 3) into a colocated LLM tp=2,dp=2 (ranks 0,1 need rows [0,3), ranks 2,3 [3,5)):
rank 0 keeps [0,2) and receives [2,3) from rank 1; rank 1 keeps [2,3) and receives [0,2)
from rank 0; rank 2 keeps [4,5) and receives [3,4) from rank 1; rank 3 receives [3,4)
from rank 1 and [4,5) from rank 2.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from parallelism.layout.errors import require
from parallelism.planner.routing import Pieces, route
from parallelism.layout.shards import HolderBoxes, chunk
from parallelism.layout.spec import ModuleLayout

I64 = np.int64


@dataclass(frozen=True, slots=True)
class ActivationShape:
    """The global (unsharded) shape of one activation: [batch, tokens, hidden]."""

    batch: int
    tokens: int
    hidden: int

    def __post_init__(self) -> None:
        for key in ("batch", "tokens", "hidden"):
            value = getattr(self, key)
            require(isinstance(value, int) and value >= 1, f"activation {key}={value} must be a positive integer")


def activation_holders(ml: ModuleLayout, shape: ActivationShape, stage: int) -> HolderBoxes:
    """The non-empty boxes of an activation on pipeline stage `stage` of module layout `ml`,
    one row per holder rank, sorted by rank."""
    require(0 <= stage < ml.pp, f"stage {stage} is not a pipeline stage of {ml.module} (pp={ml.pp})")
    dp_rank, cp_rank, tp_rank = (g.ravel() for g in np.meshgrid(
        np.arange(ml.dp), np.arange(ml.cp), np.arange(ml.tp), indexing="ij"))
    rank = ml.offset + tp_rank + ml.tp * (cp_rank + ml.cp * (dp_rank + ml.dp * stage))
    a0, a1 = chunk(shape.batch, ml.dp, dp_rank)
    b0, b1 = chunk(shape.tokens, ml.cp, cp_rank)
    keep = (a1 > a0) & (b1 > b0)
    order = np.argsort(rank[keep], kind="stable")
    return HolderBoxes(*(np.ascontiguousarray(np.asarray(x, dtype=I64)[keep][order]) for x in (rank, a0, a1, b0, b1)),
                       unit=shape.hidden)


@dataclass(frozen=True)
class Exchange:
    """One direction of a boundary: the sending and receiving layouts' boxes, and the
    pieces that move (transfers, global (batch, token) coordinates) or stay (local)."""

    send_holders: HolderBoxes
    recv_holders: HolderBoxes
    src: np.ndarray      # sender of transfer i
    boxes: Pieces        # transfer i's box; boxes.rank is its receiver
    local: Pieces        # pieces a receiver already holds as a sender
    hidden: int

    def box_of(self, holders: HolderBoxes, rank: int) -> tuple[int, int, int, int] | None:
        """The (a0, a1, b0, b1) box `rank` holds in `holders`, or None."""
        hit = int(np.searchsorted(holders.rank, rank))
        if hit < len(holders.rank) and holders.rank[hit] == rank:
            return (int(holders.a0[hit]), int(holders.a1[hit]), int(holders.b0[hit]), int(holders.b1[hit]))
        return None

    def rank_view(self, rank: int) -> RankExchange:
        """What `rank` does: its boxes and, per peer (sorted), the pieces it sends and receives."""
        sends: dict[int, list[tuple[int, int, int, int]]] = {}
        recvs: dict[int, list[tuple[int, int, int, int]]] = {}
        b = self.boxes
        for i in range(len(self.src)):
            piece = (int(b.a0[i]), int(b.a1[i]), int(b.b0[i]), int(b.b1[i]))
            if int(self.src[i]) == rank:
                sends.setdefault(int(b.rank[i]), []).append(piece)
            if int(b.rank[i]) == rank:
                recvs.setdefault(int(self.src[i]), []).append(piece)
        mine = self.local.rank == rank
        local = [(int(a0), int(a1), int(b0), int(b1)) for a0, a1, b0, b1 in
                 zip(self.local.a0[mine], self.local.a1[mine], self.local.b0[mine], self.local.b1[mine])]
        return RankExchange(rank, self.box_of(self.send_holders, rank), self.box_of(self.recv_holders, rank),
                            tuple(sorted((p, tuple(v)) for p, v in sends.items())),
                            tuple(sorted((p, tuple(v)) for p, v in recvs.items())), tuple(local))

    def canonical(self) -> dict:
        b = self.boxes
        return {"hidden": self.hidden,
                "transfers": [[int(s), int(d), int(a0), int(a1), int(b0), int(b1)] for s, d, a0, a1, b0, b1 in
                              zip(self.src, b.rank, b.a0, b.a1, b.b0, b.b1)],
                "local": [[int(r), int(a0), int(a1), int(b0), int(b1)] for r, a0, a1, b0, b1 in
                          zip(self.local.rank, self.local.a0, self.local.a1, self.local.b0, self.local.b1)]}


Box = tuple[int, int, int, int]


@dataclass(frozen=True)
class RankExchange:
    """One rank's part of an Exchange. Pieces are global (a0, a1, b0, b1) boxes; `sends`
    and `recvs` are (peer, pieces) sorted by peer, pieces in the plan's order (both ends
    agree on it, so one packed message per peer suffices)."""

    rank: int
    send_box: Box | None
    recv_box: Box | None
    sends: tuple[tuple[int, tuple[Box, ...]], ...]
    recvs: tuple[tuple[int, tuple[Box, ...]], ...]
    local: tuple[Box, ...]


@dataclass(frozen=True)
class BoundaryPlan:
    """Forward (sender layout -> receiver layout) and backward (the reverse) exchanges of
    one activation."""

    shape: ActivationShape
    forward: Exchange
    backward: Exchange

    def fingerprint(self) -> str:
        """sha256 of the canonical plan, for ranks to compare before the first exchange."""
        body = {"shape": [self.shape.batch, self.shape.tokens, self.shape.hidden],
                "forward": self.forward.canonical(), "backward": self.backward.canonical()}
        return hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()


def _exchange(send: HolderBoxes, recv: HolderBoxes, hidden: int) -> Exchange:
    # gpus_per_node=1: a "node" is one rank, so replicas are spread round-robin (a rank's
    # own copy is already taken as local before any choice is made).
    r = route(send, recv, None, gpus_per_node=1)
    return Exchange(send, recv, r.src, r.boxes, r.local, hidden)


def plan_boundary(sender: ModuleLayout, receiver: ModuleLayout, shape: ActivationShape,
                  send_stage: int | None = None, recv_stage: int = 0) -> BoundaryPlan:
    """The boundary from `sender`'s stage `send_stage` (default: its last) to `receiver`'s
    stage `recv_stage` (default: its first)."""
    send_stage = sender.pp - 1 if send_stage is None else send_stage
    src = activation_holders(sender, shape, send_stage)
    dst = activation_holders(receiver, shape, recv_stage)
    return BoundaryPlan(shape, _exchange(src, dst, shape.hidden), _exchange(dst, src, shape.hidden))
