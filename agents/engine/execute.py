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

import numpy as np
import torch
import torch.distributed as dist

from agents.engine.errors import EngineError
from agents.engine.shards import Box, Key, LocalShard, empty_shard, rank_boxes
from agents.layout.plan import RoutingPlan

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


def _pieces(plan: RoutingPlan, rank: int, round_slices) -> tuple[dict, dict, list]:
    """This rank's sends and receives per peer, and local copies, in one round (plan order)."""
    sends: dict[int, list[tuple[Key, Box]]] = defaultdict(list)
    recvs: dict[int, list[tuple[Key, Box]]] = defaultdict(list)
    local: list[tuple[Key, Box]] = []
    for sl in round_slices:
        item = plan.items[sl.item]
        key, r = (item.tensor, item.state), item.route
        b = r.boxes
        a0, a1 = np.maximum(b.a0, sl.a_lo), np.minimum(b.a1, sl.a_hi)
        for i in np.flatnonzero(((r.src == rank) | (r.dst == rank)) & (a1 > a0)):
            box = (int(a0[i]), int(a1[i]), int(b.b0[i]), int(b.b1[i]))
            if r.src[i] == rank:
                sends[int(r.dst[i])].append((key, box))
            else:
                recvs[int(r.src[i])].append((key, box))
        loc = r.local
        for i in np.flatnonzero(loc.rank == rank):
            la0, la1 = max(int(loc.a0[i]), sl.a_lo), min(int(loc.a1[i]), sl.a_hi)
            if la1 > la0:
                local.append((key, (la0, la1, int(loc.b0[i]), int(loc.b1[i]))))
    return sends, recvs, local


def _flat_bytes(view: torch.Tensor) -> torch.Tensor:
    return view.contiguous().view(-1).view(torch.uint8)


def execute_plan(plan: RoutingPlan, rank: int, old: dict[Key, LocalShard], group=None,
                 sample: Sampler | None = None) -> dict[Key, LocalShard]:
    """Move this rank's state from plan.src to plan.dst; returns the new shards."""
    check_fingerprint(plan, group)
    model = plan.model
    new_boxes = rank_boxes(plan.dst, rank)
    new: dict[Key, LocalShard] = {}
    # Boxes this rank keeps exactly are reused as they are: no copy, no new memory.
    for key, box in new_boxes.items():
        if key in old and old[key].box == box:
            new[key] = old[key]
    per_round = [_pieces(plan, rank, rs) for rs in plan.rounds]
    last_read: dict[Key, int] = {}
    for k, (sends, _, local) in enumerate(per_round):
        for key, _ in [p for peer in sends.values() for p in peer] + local:
            last_read[key] = k
    old = dict(old)
    for key in list(old):
        if key not in last_read and key not in new:
            del old[key]  # never read and not kept: free before the first round

    def live_bytes(extra: int = 0) -> int:
        ids = {id(s.data): s.nbytes for s in list(old.values()) + list(new.values())}
        return sum(ids.values()) + extra

    def target(key: Key) -> LocalShard:
        if key not in new:
            tensor = model.tensors[key[0]]
            new[key] = empty_shard(tensor, key[1], new_boxes[key])
        return new[key]

    for k, (sends, recvs, local) in enumerate(per_round):
        send_bufs = {peer: torch.cat([_flat_bytes(old[key].region(box)) for key, box in pieces])
                     for peer, pieces in sorted(sends.items())}
        recv_bufs = {}
        for peer, pieces in sorted(recvs.items()):
            size = sum(target(key).region(box).numel() * target(key).data.element_size() for key, box in pieces)
            recv_bufs[peer] = torch.empty(size, dtype=torch.uint8)
        staging = sum(b.numel() for b in send_bufs.values()) + sum(b.numel() for b in recv_bufs.values())
        if sample:
            sample(f"round {k} exchange", live_bytes(staging))
        ops = [dist.P2POp(dist.isend, buf, peer, group) for peer, buf in send_bufs.items()]
        ops += [dist.P2POp(dist.irecv, buf, peer, group) for peer, buf in recv_bufs.items()]
        if ops:
            try:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            except RuntimeError as exc:  # gloo/NCCL: a dead peer or a timeout
                raise EngineError(f"rank {rank}: round {k} of {len(per_round)} failed exchanging with ranks "
                                  f"{sorted(set(send_bufs) | set(recv_bufs))}: {exc}") from exc
        for key, box in local:
            target(key).region(box).copy_(old[key].region(box))
        for peer, pieces in sorted(recvs.items()):
            buf, offset = recv_bufs[peer], 0
            for key, box in pieces:
                view = target(key).region(box)
                nbytes = view.numel() * view.element_size()
                view.copy_(buf[offset:offset + nbytes].view(view.dtype).view(view.shape))
                offset += nbytes
            if offset != buf.numel():
                raise EngineError(f"rank {rank}: round {k} from rank {peer}: {buf.numel()} bytes received, "
                                  f"{offset} unpacked")
        del send_bufs, recv_bufs
        for key in [key for key, last in last_read.items() if last == k]:
            if key in old and not (key in new and new[key] is old[key]):
                del old[key]
        if sample:
            sample(f"round {k} done", live_bytes())

    _derive(plan, rank, new, target)
    missing = set(new_boxes) - set(new)
    if missing:
        raise EngineError(f"rank {rank}: the plan left {len(missing)} shards unfilled, e.g. {sorted(missing)[:3]}")
    return new


def _derive(plan: RoutingPlan, rank: int, new: dict[Key, LocalShard], target) -> None:
    """bf16 `param` pieces cast from the new fp32 `master` this rank now holds."""
    for item in plan.items:
        if item.state != "param":
            continue
        d = item.route.derived
        for i in np.flatnonzero(d.rank == rank):
            box = (int(d.a0[i]), int(d.a1[i]), int(d.b0[i]), int(d.b1[i]))
            target((item.tensor, "param")).region(box).copy_(new[(item.tensor, "master")].region(box))
