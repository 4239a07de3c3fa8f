"""Deterministic state values for tests and benchmarks: every element a function of
(tensor, state, global index) only, so any layout can build its shards without talking,
and bf16 `param` is exactly the cast of fp32 `master` (as mixed precision keeps it)."""
from __future__ import annotations

import numpy as np
import torch

from parallelism.engine.shards import DTYPES, Box, Key, LocalShard, box_shape, rank_boxes
from parallelism.layout.placement import Placement
from parallelism.layout.shards import b_dim
from parallelism.layout.tensors import Model


def global_index(tensor, box: Box, shape: tuple[int, ...], device: torch.device | str | None = None) -> torch.Tensor:
    """Flat index in the logical tensor of every element of a box-shaped local tensor."""
    strides = [int(np.prod(tensor.shape[d + 1:], dtype=np.int64)) for d in range(len(tensor.shape))]
    offsets = [0] * len(tensor.shape)
    offsets[0] = box[0]
    bd = b_dim(tensor)
    if bd is not None:
        offsets[bd] = box[2]
    index = torch.zeros(shape, dtype=torch.int64, device=device)
    for d, n in enumerate(shape):
        view = [1] * len(shape)
        view[d] = n
        index += ((torch.arange(n, dtype=torch.int64, device=device) + offsets[d]) * strides[d]).view(view)
    return index


def value(model: Model, key: Key, box: Box) -> torch.Tensor:
    index, state = key
    tensor = model.tensors[index]
    g = global_index(tensor, box, box_shape(tensor, box)).to(torch.float64)
    base = torch.sin(g * 0.37 + index * 1.3)
    values = {"master": base, "param": base, "exp_avg": torch.cos(g * 0.11 + index), "exp_avg_sq": base * base}
    return values[state].to(torch.float32).to(DTYPES[state])


def filled_shards(placement: Placement, rank: int, device: torch.device | str | None = None) -> dict[Key, LocalShard]:
    if rank >= placement.world:
        return {}
    model = placement.model
    return {key: LocalShard(model.tensors[key[0]], key[1], box, value(model, key, box).to(device))
            for key, box in rank_boxes(placement, rank).items()}
