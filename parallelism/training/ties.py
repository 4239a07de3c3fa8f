"""Weights held by several ranks that must take identical steps: each copy's gradient is
the sum of the copies' gradients before the optimizer (a tied embedding's two end stages,
Megatron-LM's embedding group; a kv head replicated over TP ranks, parallelism/training/kv_heads.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


@torch.no_grad()
def sum_over_groups(grads: list[tuple[Tensor, object]]) -> None:
    """All-reduce (sum) every gradient over its group, in place; one flat all-reduce per group."""
    by_group: dict[object, list[Tensor]] = {}
    for grad, group in grads:
        by_group.setdefault(group, []).append(grad)
    for group, tensors in by_group.items():
        if len(tensors) == 1:
            dist.all_reduce(tensors[0], group=group)
            continue
        flat = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view(t.shape))
            offset += t.numel()
