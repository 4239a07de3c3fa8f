"""The checkpoint-restart baseline: the same state written with torch.distributed.checkpoint
in the source layout and loaded, resharded by DCP, into the destination layout.

Each rank's boxes become DTensors on per-(module, stage) device meshes whose placements
reproduce docs/contracts.md section 2 exactly (checked against our shard maps in
tests/parallelism/layout/test_shards_vs_dtensor.py): mesh dims (tp, data) with
(Shard(tp_dim) | Replicate, Shard(0) for ZeRO | Replicate) for dense tensors, and
(ep, tp, expert-data) with (Shard(0), Shard(tp_dim) | Replicate, Shard(0) | Replicate) for
experts. Heads fewer than tp (a kv head replicated on tp/units TP ranks) split the tp
dim in two, (units, tp/units), with (Shard(tp_dim), Replicate): the first shards by head,
the second replicates each head over the ranks sharing it, as the contract's boxes do.
"""
from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from parallelism.engine.errors import EngineError
from parallelism.engine.shards import Key, LocalShard, empty_shard, rank_boxes, state_device
from parallelism.layout.placement import Placement
from parallelism.layout.shards import STATE_CLASS, is_sharded


def layout_meshes(placement: Placement, device_type: str = "cpu") -> dict[tuple, DeviceMesh]:
    """(module, stage, expert) -> mesh, and (module, stage, ("heads", units)) -> the mesh of
    tensors whose units are fewer than tp; built by every rank of the world in the same order
    (group creation is collective over the default group: build them while every rank of
    it is there, and reuse them). `device_type`: where the state is (cuda: NCCL groups)."""
    meshes = {}
    for module in placement.model.modules:
        ml = placement.modules[module.name]
        data = ml.dp * ml.cp
        for stage in range(ml.pp):
            ranks = torch.arange(ml.tp * data) + ml.offset + stage * ml.tp * data
            grid = ranks.view(data, ml.tp)  # rank = tp_rank + tp * d
            meshes[(module.name, stage, False)] = DeviceMesh(device_type, grid.t().contiguous(),
                                                             mesh_dim_names=("tp", "data"))
            for units in _replicated_units(placement, module.name):
                heads = grid.t().reshape(units, ml.tp // units, data)  # tp_rank = head * (tp/units) + copy
                meshes[(module.name, stage, ("heads", units))] = DeviceMesh(
                    device_type, heads.contiguous(), mesh_dim_names=("head", "copy", "data"))
            if module.num_experts:
                # d = ep_rank + ep * edp_rank  ->  dims (ep, tp, edp)
                experts = grid.view(data // ml.ep, ml.ep, ml.tp).permute(1, 2, 0).contiguous()
                meshes[(module.name, stage, True)] = DeviceMesh(device_type, experts,
                                                                mesh_dim_names=("ep", "tp", "edp"))
    return meshes


def _replicated_units(placement: Placement, module: str) -> list[int]:
    """The unit counts (kv heads) of the module's tensors that have fewer units than tp."""
    tp = placement.modules[module].tp
    return sorted({t.split.tp_units for t in placement.model.tensors
                   if t.split.module == module and t.split.tp_units is not None and t.split.tp_units < tp})


def _mesh_kind(tensor, ml) -> bool | tuple[str, int]:
    """Which of a stage's meshes holds the tensor: experts (True), replicated heads, dense (False)."""
    units = tensor.split.tp_units
    if units is not None and units < ml.tp:
        if tensor.is_expert:
            raise EngineError(f"{tensor.name}: expert tensors split by heads are not supported")
        return ("heads", units)
    return tensor.is_expert


def _placements(tensor, state: str, ml) -> list:
    split = tensor.split
    tp = Shard(split.tp_dim) if split.tp_dim is not None else Replicate()
    zero = Shard(0) if is_sharded(STATE_CLASS[state], ml.zero) else Replicate()
    if split.tp_units is not None and split.tp_units < ml.tp:
        return [tp, Replicate(), zero]  # mesh (head, copy, data)
    return [Shard(0), tp, zero] if split.ep_dim is not None else [tp, zero]


def check_expressible(placement: Placement) -> None:
    """Fail before any work when a layout has boxes DTensor cannot describe."""
    for tensor in placement.model.tensors:
        _mesh_kind(tensor, placement.modules[tensor.split.module])


def to_dtensors(placement: Placement, rank: int, shards: dict[Key, LocalShard],
                meshes: dict | None = None) -> dict[str, DTensor]:
    """This rank's shards as DTensors (keys "tensor/state"); `meshes` from layout_meshes."""
    meshes = meshes or layout_meshes(placement, state_device(shards).type)
    out = {}
    for (index, state), shard in sorted(shards.items()):
        tensor = placement.model.tensors[index]
        ml = placement.modules[tensor.split.module]
        kind = _mesh_kind(tensor, ml)
        stages = [s for s in placement.tensor_stages(tensor)
                  if (meshes[(tensor.split.module, s, kind)].mesh == rank).any()]
        mesh = meshes[(tensor.split.module, stages[0], kind)]
        global_stride = torch.empty(tensor.shape, device="meta").stride()
        out[f"{tensor.name}/{state}"] = DTensor.from_local(
            shard.data, mesh, _placements(tensor, state, ml), run_check=False,
            shape=torch.Size(tensor.shape), stride=global_stride)
    return out


def checkpoint_switch(src: Placement, dst: Placement, rank: int, shards: dict[Key, LocalShard],
                      path: str) -> dict[Key, LocalShard]:
    """Save `shards` (layout src) with DCP, load them into layout dst; returns the new shards."""
    # Every rank builds every mesh (group creation is collective), holder or not.
    device = state_device(shards)
    saved = to_dtensors(src, rank, shards, layout_meshes(src, device.type))
    dcp.save(saved, checkpoint_id=path)
    del saved
    boxes = rank_boxes(dst, rank) if rank < dst.world else {}
    new = {key: empty_shard(dst.model.tensors[key[0]], key[1], box, device) for key, box in boxes.items()}
    state = to_dtensors(dst, rank, new, layout_meshes(dst, device.type))
    dcp.load(state, checkpoint_id=path)  # DCP reads into the DTensors' local tensors, i.e. into `new`
    return new
