"""A layout-independent digest of every logical state tensor, computed on the shards
(nothing is gathered) and compared before and after a switch.

digest(tensor, state) = sum over its elements of (bits(e) + 1) * mix(i) modulo 2^64, where
i is the element's global flat index and mix(i) = (i * K + C) | 1 is odd. Every element
is counted once: among ranks holding an identical box (replicas), the lowest one counts
it. Integer arithmetic wraps modulo 2^64 on every rank and in the all-reduce alike, so
the same values give the same digest in any layout, and changing any one element always
changes it (an odd multiplier times a non-zero difference below 2^32 is never 0 mod 2^64).
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from parallelism.engine.errors import EngineError
from parallelism.engine.shards import Key, LocalShard, collective_device
from parallelism.engine.state_fill import global_index
from parallelism.layout.placement import Placement
from parallelism.layout.shards import STATE_CLASS, holder_boxes
from parallelism.layout.tensors import STATES

_K = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (golden-ratio constant)
_C = 0x632BE59BD9B4E019


def owned_keys(placement: Placement, rank: int) -> set[Key]:
    """(tensor, state) boxes this rank counts: it is the lowest rank holding that box (none
    for a rank beyond the placement's world)."""
    if rank >= placement.world:
        return set()
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
    return global_index(shard.tensor, shard.box, tuple(shard.data.shape), shard.data.device)


def shard_digest(shard: LocalShard) -> int:
    data = shard.data.contiguous()
    if data.dtype == torch.bfloat16:
        bits = data.view(torch.int16).to(torch.int64) & 0xFFFF
    elif data.dtype == torch.float32:
        bits = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    else:
        raise EngineError(f"digest: unsupported dtype {data.dtype} for {shard.tensor.name}/{shard.state}")
    mix = _global_index(shard).mul_(_K).add_(_C).bitwise_or_(1)  # int64 arithmetic wraps mod 2^64
    return int(bits.add_(1).mul_(mix).sum().item())


def _owners(placement: Placement, tensor, state_class: str, process_of=None) -> set[tuple]:
    """(process, box) of each distinct box's counting holder (its lowest rank)."""
    h = holder_boxes(placement, tensor, state_class)
    if not len(h.rank):
        return set()
    boxes = np.stack([h.a0, h.a1, h.b0, h.b1], axis=1)
    _, first = np.unique(boxes, axis=0, return_index=True)  # holders are sorted by rank: the lowest
    ranks = h.rank[first] if process_of is None else np.asarray(process_of)[h.rank[first]]
    return {(int(r), *map(int, b)) for r, b in zip(ranks, boxes[first])}


def unchanged_keys(plan) -> frozenset[Key]:
    """(tensor, state) whose counted boxes are the same boxes on the same processes in both
    layouts. The engine keeps a box that is the same in both layouts untouched (no copy:
    execute_plan reuses the tensor), so their digests before and after are equal without
    computing them: verification hashes only what a switch rewrites. The same set on every
    rank (it is a function of the plan)."""
    out = set()
    for index, tensor in enumerate(plan.model.tensors):
        for state_class in {STATE_CLASS[s] for s in STATES}:
            if _owners(plan.src, tensor, state_class) == _owners(plan.dst, tensor, state_class, plan.process_of):
                out |= {(index, s) for s in STATES if STATE_CLASS[s] == state_class}
    return frozenset(out)


def state_digests(placement: Placement, rank: int, shards: dict[Key, LocalShard], group=None,
                  skip: frozenset[Key] = frozenset(), owned: set[Key] | None = None) -> dict[Key, int]:
    """Digest of every (tensor, state) of the model but those in `skip`; a collective over
    `group` (every rank must skip the same keys). `owned`: owned_keys(placement, rank),
    when worked out ahead."""
    keys = [(i, s) for i in range(len(placement.model.tensors)) for s in STATES if (i, s) not in skip]
    owned = owned_keys(placement, rank) if owned is None else owned
    local = torch.tensor([shard_digest(shards[k]) if k in owned and k in shards else 0 for k in keys],
                         dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(local, group=group)
    return dict(zip(keys, local.tolist()))


def tensor_checks(model, before: dict[Key, int], after: dict[Key, int]) -> list[dict]:
    """One row per logical tensor, in the model's order: {name, shape, match, mismatched
    (the states whose digest changed), digest (its compared states' digests after the
    switch, summed modulo 2^64, as 16 hex digits; "" when the switch left every state of
    the tensor untouched: unchanged_keys)} -- what the transition page lists."""
    rows = []
    for i, tensor in enumerate(model.tensors):
        states = [state for (j, state) in before if j == i]
        mismatched = [state for state in states if before[(i, state)] != after.get((i, state))]
        combined = sum(after.get((i, state), 0) for state in states) % 2**64
        rows.append({"name": tensor.name, "shape": list(tensor.shape), "match": not mismatched,
                     "mismatched": mismatched, "digest": f"{combined:016x}" if states else ""})
    return rows


class VerificationError(EngineError):
    """Digests differ after a switch; `checks` holds tensor_checks' rows."""

    def __init__(self, message: str, checks: list[dict]) -> None:
        super().__init__(message)
        self.checks = checks


def compare_digests(model, before: dict[Key, int], after: dict[Key, int]) -> list[dict]:
    """tensor_checks' rows; raise VerificationError naming every logical tensor whose
    digest changed."""
    checks = tensor_checks(model, before, after)
    bad = [f"{row['name']}/{state}" for row in checks for state in row["mismatched"]]
    if bad:
        raise VerificationError(f"verification failed for {len(bad)} tensor states: {', '.join(bad[:8])}"
                                + (" ..." if len(bad) > 8 else ""), checks)
    return checks
