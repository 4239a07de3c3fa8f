"""execute_plan: run a routing plan on this rank's real tensors. No decisions here: the
plan says what moves where and when; this only packs, exchanges and unpacks.

Per round: pack every outgoing piece for a peer into one byte buffer (the plan's order),
post all sends and receives of the round at once (batch_isend_irecv; both ends agree on
the round, so they pair up), copy local pieces, unpack, then drop old shards nothing
reads any more. A bf16 `param` the plan derives is cast from the new fp32 `master` last.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from parallelism.engine.errors import EngineError
from parallelism.engine.shards import DTYPES, Box, Key, LocalShard, box_shape, empty_shard, state_device
from parallelism.planner.plan import RoutingPlan
from parallelism.layout.shards import b_dim

Sampler = Callable[[str, int], None]  # (label, live bytes)


def check_fingerprint(plan: RoutingPlan, group=None) -> None:
    """Every rank must hold the same plan before the first transfer."""
    mine = plan.fingerprint
    everyone: list[str] = [""] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    odd = [r for r, f in enumerate(everyone) if f != everyone[0]]
    if odd:
        raise EngineError(f"plan fingerprints differ: rank 0 has {everyone[0][:12]}, ranks {odd} have "
                          f"{sorted({everyone[r][:12] for r in odd})}; refusing to switch")


@dataclass
class SlicePieces:
    """What one slice of a round means for this rank, in the plan's order. A piece is
    `direct` when its region is contiguous in the receiver's new box: it then travels as a
    message of its own and lands in place (no unpack copy); a direct send whose region is
    also contiguous in the source box leaves as a view of it, without a pack copy."""

    key: Key
    sends: list[tuple[int, Box, bool]]  # (peer, box, direct)
    recvs: list[tuple[int, Box, bool]]        # (peer, box, direct)
    local: list[Box]


def contiguous_in(tensor, holder: Box, piece: Box) -> bool:
    """Is `piece` one contiguous run of memory inside a C-contiguous tensor of box `holder`?
    Rows (dim 0) of a box are contiguous when the B range is the box's whole B range, or
    when it is a single row whose dims before B are all 1."""
    bd = b_dim(tensor)
    if bd is None or (piece[2], piece[3]) == (holder[2], holder[3]):
        return True
    return piece[1] - piece[0] == 1 and int(np.prod(tensor.shape[1:bd], dtype=np.int64)) == 1


def _box_of(holders, rank: int) -> Box:
    i = int(np.searchsorted(holders.rank, rank))
    return (int(holders.a0[i]), int(holders.a1[i]), int(holders.b0[i]), int(holders.b1[i]))


def _slices(plan: RoutingPlan, rank: int, round_slices, mine: dict) -> list[SlicePieces]:
    out = []
    for sl in round_slices:
        item = plan.items[sl.item]
        r, b = item.route, item.route.boxes
        if id(r) not in mine:  # this rank's rows of a route, found once per route
            mine[id(r)] = (np.flatnonzero((r.src == rank) | (r.dst == rank)), np.flatnonzero(r.local.rank == rank))
        rows, local_rows = mine[id(r)]
        rows = rows[(rows >= sl.t_lo) & (rows < (len(r.src) if sl.t_hi is None else sl.t_hi))]
        a0, a1 = np.maximum(b.a0[rows], sl.a_lo), np.minimum(b.a1[rows], sl.a_hi)
        pieces = SlicePieces((item.tensor, item.state), [], [], [])
        tensor = plan.model.tensors[item.tensor]
        for j in np.flatnonzero(a1 > a0):
            i = rows[j]
            box = (int(a0[j]), int(a1[j]), int(b.b0[i]), int(b.b1[i]))
            if r.src[i] == rank:
                peer = int(r.dst[i])
                pieces.sends.append((peer, box, contiguous_in(tensor, _box_of(r.dst_holders, peer), box)))
            else:
                pieces.recvs.append((int(r.src[i]), box, contiguous_in(tensor, _box_of(r.dst_holders, rank), box)))
        loc = r.local
        for i in (local_rows if sl.t_lo == 0 else ()):  # local copies once per row range
            la0, la1 = max(int(loc.a0[i]), sl.a_lo), min(int(loc.a1[i]), sl.a_hi)
            if la1 > la0:
                pieces.local.append((la0, la1, int(loc.b0[i]), int(loc.b1[i])))
        out.append(pieces)
    return out


@dataclass
class RankProgram:
    """Everything one rank does in a switch, worked out from the plan ahead of time (while
    training goes on), so that the pause is only the exchange itself."""

    rank: int
    new_boxes: dict[Key, Box]
    rounds: list[list[SlicePieces]]
    last_send: dict[Key, int]
    last_local: dict[Key, tuple[int, int]]


def _boxes_from_routes(plan: RoutingPlan, rank: int) -> dict[Key, Box]:
    out: dict[Key, Box] = {}
    for item in plan.items:
        h = item.route.dst_holders
        hit = int(np.searchsorted(h.rank, rank))
        if hit < len(h.rank) and h.rank[hit] == rank:
            out[(item.tensor, item.state)] = (int(h.a0[hit]), int(h.a1[hit]), int(h.b0[hit]), int(h.b1[hit]))
    return out


def prepare(plan: RoutingPlan, rank: int) -> RankProgram:
    mine: dict = {}
    rounds = [_slices(plan, rank, rs, mine) for rs in plan.rounds]
    last_send: dict[Key, int] = {}
    last_local: dict[Key, tuple[int, int]] = {}
    for k, slices in enumerate(rounds):
        for j, p in enumerate(slices):
            if p.sends:
                last_send[p.key] = k
            if p.local:
                last_local[p.key] = (k, j)
    return RankProgram(rank, _boxes_from_routes(plan, rank), rounds, last_send, last_local)


def _nbytes(model, key: Key, box: Box) -> int:
    return int(np.prod(box_shape(model.tensors[key[0]], box))) * DTYPES[key[1]].itemsize


def packed_sizes(model, slices: list[SlicePieces]) -> tuple[dict[int, int], dict[int, int]]:
    """Bytes of the packed (non-direct) pieces this rank sends to and receives from each
    peer in one round."""
    outgoing: dict[int, int] = defaultdict(int)
    incoming: dict[int, int] = defaultdict(int)
    for p in slices:
        for peer, box, direct in p.sends:
            if not direct:
                outgoing[peer] += _nbytes(model, p.key, box)
        for peer, box, direct in p.recvs:
            if not direct:
                incoming[peer] += _nbytes(model, p.key, box)
    return outgoing, incoming


def round_messages(model, slices: list[SlicePieces]) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Sizes of the messages this rank sends to and receives from each peer in one round, in
    the order both ends post them: the packed buffer (if any), then each direct piece."""
    packed_out, packed_in = packed_sizes(model, slices)
    outgoing: dict[int, list[int]] = {peer: [n] for peer, n in packed_out.items()}
    incoming: dict[int, list[int]] = {peer: [n] for peer, n in packed_in.items()}
    for p in slices:
        for peer, box, direct in p.sends:
            if direct:
                outgoing.setdefault(peer, []).append(_nbytes(model, p.key, box))
        for peer, box, direct in p.recvs:
            if direct:
                incoming.setdefault(peer, []).append(_nbytes(model, p.key, box))
    return outgoing, incoming


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


PAGE = 4096


def _prefault(buf: torch.Tensor) -> None:
    """Touch every page of a host receive buffer (its bytes are about to be overwritten).
    Measured on this machine's VM: a TCP receive into never-touched pages ran at 0.17 GB/s,
    against 1.6-2.1 GB/s after one write per page (which itself costs 0.15 s per 374 MB).
    Device memory from the CUDA caching allocator needs nothing of the kind."""
    if buf.device.type == "cpu" and buf.numel() >= PAGE:
        buf[::PAGE].zero_()


def preallocate(plan: RoutingPlan, program: RankProgram, device: torch.device | None = None) -> dict[Key, LocalShard]:
    """A joining rank (one that holds no source state) allocates and touches all its new
    shards ahead of the switch, while the old world still trains: its memory then is its
    destination bytes, which it reaches anyway, and the exchange does not stall on first-touch
    page faults (CPU) or allocator growth (GPU). Ranks holding source state must not: it would
    break the bound max(source, destination) + staging."""
    return {key: LocalShard(s.tensor, s.state, s.box, s.data.zero_())
            for key, s in ((key, empty_shard(plan.model.tensors[key[0]], key[1], box, device))
                           for key, box in program.new_boxes.items())}


def execute_plan(plan: RoutingPlan, rank: int, old: dict[Key, LocalShard], group=None,
                 sample: Sampler | None = None, program: RankProgram | None = None,
                 ready: dict[Key, LocalShard] | None = None) -> dict[Key, LocalShard]:
    """Move this rank's state from plan.src to plan.dst; returns the new shards. Consumes
    `old`: its entries are removed as the shards are freed (only kept boxes may remain).
    New shards and staging buffers go where the state is (state_device: a GPU's state stays
    on it; NCCL moves device buffers).

    Memory follows the planner's model (parallelism/planner/schedule.py memory_wave): per round,
    pack -> free sources read for the last time (unless a local copy still needs them) ->
    local copies slice by slice (destination allocated on first touch, sources freed after
    their last copy) -> receiving boxes and buffers allocated -> exchange -> unpack.
    """
    check_fingerprint(plan, group)
    model = plan.model
    device = state_device(old or ready or {}, group)
    program = program or prepare(plan, rank)
    new_boxes, per_round = program.new_boxes, program.rounds
    last_send, last_local = program.last_send, program.last_local
    if ready and old:
        raise EngineError(f"rank {rank}: preallocated shards are only for joining ranks (no source state)")
    new: dict[Key, LocalShard] = dict(ready or {})
    for key, box in new_boxes.items():  # boxes kept exactly: reused, no copy, no new memory
        if key in old and old[key].box == box:
            new[key] = old[key]
    kept = {key for key in new if key in old}
    live = _LiveBytes([*old.values(), *(s for key, s in new.items() if key not in kept)])
    # `old` is consumed, not copied: a shard leaves it the moment nothing more reads it, so
    # that (with no other reference left, see ParallelTrainer.hand_over) its memory is freed.

    def release(key: Key) -> None:
        if key in old and key not in kept:
            live.remove(old.pop(key))

    for key in list(old):
        if key not in last_send and key not in last_local:
            release(key)  # never read again: free before the first round

    def live_bytes(extra: int = 0) -> int:
        return live.total + extra

    if sample:
        sample("start", live_bytes())

    def target(key: Key) -> LocalShard:
        if key not in new:
            new[key] = empty_shard(model.tensors[key[0]], key[1], new_boxes[key], device)
            live.add(new[key])
        return new[key]

    for k, slices in enumerate(per_round):
        packed_out, packed_in = packed_sizes(model, slices)
        send_msgs: dict[int, list[torch.Tensor]] = {peer: [torch.empty(n, dtype=torch.uint8, device=device)]
                                                    for peer, n in sorted(packed_out.items())}
        packed: dict[int, int] = defaultdict(int)
        staging = sum(n for n in packed_out.values())
        sent_from: dict[Key, int] = {}  # source boxes the round's messages are views of
        for p in slices:  # pack straight into each peer's buffer: one copy per byte
            for peer, box, direct in p.sends:
                view = old[p.key].region(box)
                if direct:  # a message of its own; a contiguous region leaves without a copy
                    if view.is_contiguous():
                        send_msgs.setdefault(peer, []).append(_bytes_view(view))
                        sent_from[p.key] = old[p.key].nbytes
                    else:
                        send_msgs.setdefault(peer, []).append(_bytes_view(view.contiguous()))
                        staging += view.numel() * view.element_size()
                    continue
                n = view.numel() * view.element_size()
                send_msgs[peer][0][packed[peer]:packed[peer] + n].view(view.dtype).view(view.shape).copy_(view)
                packed[peer] += n
        if sample:
            sample(f"round {k} packed", live_bytes(staging))
        for key in {p.key for p in slices if last_send.get(p.key) == k}:
            if last_local.get(key, (-1, -1))[0] < k or key not in last_local:
                release(key)  # its last transfer is packed and no local copy is pending
        send_ops = [dist.P2POp(dist.isend, buf, peer, group, tag) for peer, msgs in sorted(send_msgs.items())
                    for tag, buf in enumerate(msgs)]
        # gloo sends one message at a time and needs nothing from the peer to start it: post the
        # sends now so they travel while this rank copies locally. (NCCL must post a round's sends
        # and receives in one group, or two ranks sending to each other deadlock.)
        early_works = (_post(send_ops, rank, k, len(per_round), sorted(send_msgs))
                       if send_ops and _backend(group) == "gloo" else None)
        # Local copies before the exchange: their sources are freed before this round's
        # receiving boxes and buffers are allocated.
        for j, p in enumerate(slices):
            for box in p.local if p.key not in kept else ():  # a kept box already holds its data
                target(p.key).region(box).copy_(old[p.key].region(box))
            if p.local and sample:
                sample(f"round {k} local", live_bytes(staging + sum(n for key, n in sent_from.items()
                                                                    if key not in old)))
            if last_local.get(p.key) == (k, j) and last_send.get(p.key, -1) <= k:
                release(p.key)
        # A box a message is a view of stays alive until the exchange is done: once released
        # from `old`, count it as staging.
        staging += sum(n for key, n in sent_from.items() if key not in old)
        recv_bufs = {peer: torch.empty(n, dtype=torch.uint8, device=device) for peer, n in sorted(packed_in.items())}
        recv_msgs: dict[int, list[torch.Tensor]] = {peer: [buf] for peer, buf in recv_bufs.items()}
        for p in slices:
            for peer, box, direct in p.recvs:
                if direct:  # lands in place
                    recv_msgs.setdefault(peer, []).append(_bytes_view(target(p.key).region(box)))
        for msgs in recv_msgs.values():
            for buf in msgs:
                _prefault(buf)
        staging += sum(packed_in.values())
        if sample:
            sample(f"round {k} exchange", live_bytes(staging))
        recv_ops = [dist.P2POp(dist.irecv, buf, peer, group, tag) for peer, msgs in sorted(recv_msgs.items())
                    for tag, buf in enumerate(msgs)]
        peers = sorted(set(send_msgs) | set(recv_msgs))
        try:
            works = (early_works or []) + _post(recv_ops if early_works is not None else send_ops + recv_ops,
                                                rank, k, len(per_round), peers)
            for work in works:
                work.wait()
        except RuntimeError as exc:  # gloo/NCCL: a dead peer or a timeout
            raise EngineError(f"rank {rank}: round {k} of {len(per_round)} failed exchanging with ranks "
                              f"{peers}: {exc}") from exc
        del send_ops, recv_ops, send_msgs, recv_msgs, works, early_works
        if sample:
            sample(f"round {k} received", live_bytes(staging))
        cursor: dict[int, int] = defaultdict(int)
        for p in slices:
            for peer, box, direct in p.recvs:
                if direct:
                    continue
                view = target(p.key).region(box)
                n = view.numel() * view.element_size()
                view.copy_(recv_bufs[peer][cursor[peer]:cursor[peer] + n].view(view.dtype).view(view.shape))
                cursor[peer] += n
            if p.recvs and sample:
                sample(f"round {k} unpack", live_bytes(staging))
        for peer, buf in recv_bufs.items():
            if cursor[peer] != buf.numel():
                raise EngineError(f"rank {rank}: round {k} from rank {peer}: {buf.numel()} bytes received, "
                                  f"{cursor[peer]} unpacked")
        del recv_bufs
        if sample:
            sample(f"round {k} done", live_bytes())

    _derive(plan, rank, new, target)
    if sample:
        sample("derived", live_bytes())
    missing = set(new_boxes) - set(new)
    if missing:
        raise EngineError(f"rank {rank}: the plan left {len(missing)} shards unfilled, e.g. {sorted(missing)[:3]}")
    return new


class _LiveBytes:
    """Bytes of the distinct tensors among the shards alive on this rank, kept as a running
    total (summing every shard at each sample cost more than the copies it measured)."""

    def __init__(self, shards) -> None:
        self._refs: dict[int, list[int]] = {}
        self.total = 0
        for shard in shards:
            self.add(shard)

    def add(self, shard: LocalShard) -> None:
        ref = self._refs.setdefault(id(shard.data), [0, shard.nbytes])
        if ref[0] == 0:
            self.total += ref[1]
        ref[0] += 1

    def remove(self, shard: LocalShard) -> None:
        ref = self._refs[id(shard.data)]
        ref[0] -= 1
        if ref[0] == 0:
            self.total -= ref[1]
            del self._refs[id(shard.data)]


def _backend(group) -> str:
    return dist.get_backend(group)


def _post(ops: list, rank: int, k: int, rounds: int, peers: list[int]) -> list:
    """Post a round's transfers. A dead peer can fail the post itself (gloo's send on a reset
    connection) as well as the wait: both name the ranks this round exchanges with."""
    if not ops:
        return []
    try:
        return dist.batch_isend_irecv(ops)
    except RuntimeError as exc:
        raise EngineError(f"rank {rank}: round {k} of {rounds} failed exchanging with ranks {peers} "
                          f"(posting transfers): {exc}") from exc


def _derive(plan: RoutingPlan, rank: int, new: dict[Key, LocalShard], target) -> None:
    """bf16 `param` pieces cast from the new fp32 `master` this rank now holds."""
    for item in plan.items:
        if item.state != "param":
            continue
        d = item.route.derived
        for i in np.flatnonzero(d.rank == rank):
            box = (int(d.a0[i]), int(d.a1[i]), int(d.b0[i]), int(d.b1[i]))
            target((item.tensor, "param")).region(box).copy_(new[(item.tensor, "master")].region(box))
