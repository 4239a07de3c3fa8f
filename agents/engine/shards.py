"""A rank's training state as local shards: one torch tensor per (tensor, state) box it
holds, addressed in the layout core's (A, B) box coordinates (agents/layout/shards.py)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from agents.layout.placement import Placement
from agents.layout.shards import STATE_CLASS, b_dim, holder_boxes
from agents.layout.tensors import STATES, TensorSpec

DTYPES = {"param": torch.bfloat16, "master": torch.float32, "exp_avg": torch.float32, "exp_avg_sq": torch.float32}
Box = tuple[int, int, int, int]  # a0, a1, b0, b1
Key = tuple[int, str]  # (tensor index in the model's global order, state)


def box_shape(tensor: TensorSpec, box: Box) -> tuple[int, ...]:
    shape = list(tensor.shape)
    shape[0] = box[1] - box[0]
    bd = b_dim(tensor)
    if bd is not None:
        shape[bd] = box[3] - box[2]
    return tuple(shape)


@dataclass
class LocalShard:
    tensor: TensorSpec
    state: str
    box: Box
    data: torch.Tensor

    def region(self, sub: Box) -> torch.Tensor:
        """A view of the rows/columns `sub` (global box coordinates, inside self.box)."""
        a0, _, b0, _ = self.box
        view = self.data.narrow(0, sub[0] - a0, sub[1] - sub[0])
        bd = b_dim(self.tensor)
        if bd is not None:
            view = view.narrow(bd, sub[2] - b0, sub[3] - sub[2])
        return view

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


def rank_boxes(placement: Placement, rank: int) -> dict[Key, Box]:
    """Every (tensor, state) box this rank holds in a placement."""
    out: dict[Key, Box] = {}
    for index, tensor in enumerate(placement.model.tensors):
        for state in STATES:
            boxes = holder_boxes(placement, tensor, STATE_CLASS[state])
            hit = int(np.searchsorted(boxes.rank, rank))
            if hit < len(boxes.rank) and boxes.rank[hit] == rank:
                out[(index, state)] = (int(boxes.a0[hit]), int(boxes.a1[hit]), int(boxes.b0[hit]), int(boxes.b1[hit]))
    return out


def empty_shard(tensor: TensorSpec, state: str, box: Box) -> LocalShard:
    return LocalShard(tensor, state, box, torch.empty(box_shape(tensor, box), dtype=DTYPES[state]))
