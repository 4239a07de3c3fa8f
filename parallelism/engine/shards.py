"""A rank's training state as local shards: one torch tensor per (tensor, state) box it
holds, addressed in the layout core's (A, B) box coordinates (parallelism/layout/shards.py)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallelism.layout.placement import Placement
from parallelism.layout.shards import STATE_CLASS, b_dim, holder_boxes
from parallelism.layout.tensors import STATES, TensorSpec

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


def rank_boxes(placement: Placement, rank: int, *, keep_empty: bool = False) -> dict[Key, Box]:
    """Every (tensor, state) box this rank holds in a placement; with `keep_empty`, also the
    zero-size ones (its torch.chunk part is empty), which plans, digests and checkpoints
    leave out but a trainer still needs as empty tensors."""
    out: dict[Key, Box] = {}
    for index, tensor in enumerate(placement.model.tensors):
        for state in STATES:
            boxes = holder_boxes(placement, tensor, STATE_CLASS[state], keep_empty=keep_empty, only_rank=rank)
            if len(boxes.rank):
                out[(index, state)] = (int(boxes.a0[0]), int(boxes.a1[0]), int(boxes.b0[0]), int(boxes.b1[0]))
    return out


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective over `group` must be: this process's current CUDA
    device for NCCL, the host for gloo."""
    import torch.distributed as dist

    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def state_device(shards: dict, group=None) -> torch.device:
    """Where a switch allocates on this rank: the device of the state it holds, else (a
    joining rank) the group's collective device."""
    for shard in shards.values():
        return shard.data.device
    return collective_device(group)


def empty_shard(tensor: TensorSpec, state: str, box: Box, device: torch.device | str | None = None) -> LocalShard:
    return LocalShard(tensor, state, box, torch.empty(box_shape(tensor, box), dtype=DTYPES[state], device=device))


def trainer_states(placement: Placement, rank: int, shards: dict[Key, LocalShard]) -> dict[int, tuple]:
    """(param, master, exp_avg, exp_avg_sq) tensors by tensor index, for every tensor the rank
    holds in some state. A zero-size box is never a shard (docs/contracts.md section 3: left out), so
    it becomes an empty tensor here, e.g. the 1-row class token's ZeRO chunks on dp ranks >= 1.
    Raises KeyError naming up to three missing non-empty boxes."""
    expected = rank_boxes(placement, rank, keep_empty=True)
    missing = sorted(k for k, box in expected.items() if k not in shards and _size(placement, k, box))
    if missing:
        names = [(placement.model.tensors[i].name, s) for i, s in missing[:3]]
        raise KeyError(f"rank {rank}: no shard for {len(missing)} boxes of the layout, e.g. {names}")
    out: dict[int, tuple] = {}
    for index in sorted({i for i, _ in expected}):
        tensor = placement.model.tensors[index]
        out[index] = tuple(shards[(index, s)].data if (index, s) in shards
                           else empty_shard(tensor, s, expected[(index, s)]).data for s in STATES)
    return out


def _size(placement: Placement, key: Key, box: Box) -> int:
    return (box[1] - box[0]) * (box[3] - box[2] if b_dim(placement.model.tensors[key[0]]) is not None else 1)
