"""A layout-independent digest of every logical state tensor, computed on the shards
(nothing is gathered) and compared before and after a switch.

digest(tensor, state) = sum over its elements of h(e) mod P, P = 2^31 - 1, with
h(e) = (bits(e) mod P + 1) * mix(global index of e) mod P and mix in [1, P-1]. Every
element is counted once: among ranks holding an identical box (replicas), the lowest one
counts it. Exact integer arithmetic, so the same values give the same digest in any
layout; changing any one element changes it (unless its bit pattern moves by a multiple
of P, which a 16- or 32-bit pattern can do only by exactly P).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from agents.engine.errors import EngineError
from agents.engine.shards import Key, LocalShard
from agents.layout.placement import Placement
from agents.layout.shards import STATE_CLASS, b_dim, holder_boxes
from agents.layout.tensors import STATES

P = 2**31 - 1
_A, _B = 1_103_515_245 % P, 12_345


def _owned(placement: Placement, rank: int) -> set[Key]:
    """(tensor, state) boxes this rank counts: it is the lowest rank holding that box."""
    out = set()
    for index, tensor in enumerate(placement.model.tensors):
        for state in STATES:
            h = holder_boxes(placement, tensor, STATE_CLASS[state])
            mine = np.flatnonzero(h.rank == rank)
            if len(mine):
                i = mine[0]
                same = (h.a0 == h.a0[i]) & (h.a1 == h.a1[i]) & (h.b0 == h.b0[i]) & (h.b1 == h.b1[i])
                if h.rank[same].min() == rank:
                    out.add((index, state))
    return out


def _global_index(shard: LocalShard) -> torch.Tensor:
    """Flat index in the logical tensor of every element of the shard (int64)."""
    shape = shard.tensor.shape
    strides = [int(np.prod(shape[d + 1:], dtype=np.int64)) for d in range(len(shape))]
    offsets = [0] * len(shape)
    offsets[0] = shard.box[0]
    bd = b_dim(shard.tensor)
    if bd is not None:
        offsets[bd] = shard.box[2]
    index = torch.zeros(shard.data.shape, dtype=torch.int64)
    for d, n in enumerate(shard.data.shape):
        view = [1] * len(shape)
        view[d] = n
        index += ((torch.arange(n, dtype=torch.int64) + offsets[d]) * strides[d]).view(view)
    return index


def shard_digest(shard: LocalShard) -> int:
    data = shard.data.contiguous()
    if data.dtype == torch.bfloat16:
        bits = data.view(torch.int16).to(torch.int64) & 0xFFFF
    elif data.dtype == torch.float32:
        bits = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        raise EngineError(f"digest: unsupported dtype {data.dtype} for {shard.tensor.name}/{shard.state}")
    mix = ((_global_index(shard) % P) * _A + _B) % (P - 1) + 1
    return int((((bits % P) + 1) * mix % P).sum().item() % P)


def state_digests(placement: Placement, rank: int, shards: dict[Key, LocalShard], group=None) -> dict[Key, int]:
    """Digest of every (tensor, state) of the model; a collective over `group`."""
    keys = [(i, s) for i in range(len(placement.model.tensors)) for s in STATES]
    owned = _owned(placement, rank) if rank < placement.world else set()
    local = torch.tensor([shard_digest(shards[k]) if k in owned and k in shards else 0 for k in keys],
                         dtype=torch.int64)
    dist.all_reduce(local, group=group)
    return {k: int(v) % P for k, v in zip(keys, local.tolist())}


def compare_digests(model, before: dict[Key, int], after: dict[Key, int]) -> None:
    """Raise naming every logical tensor whose digest changed."""
    bad = [f"{model.tensors[i].name}/{state}" for (i, state) in before if before[(i, state)] != after.get((i, state))]
    if bad:
        raise EngineError(f"verification failed for {len(bad)} tensor states: {', '.join(bad[:8])}"
                          + (" ..." if len(bad) > 8 else ""))
