"""Key/value heads replicated under tensor parallelism (GQA with fewer kv heads than tp).

With kv_heads < tp, docs/contracts.md section 2 gives each kv head to tp/kv_heads
consecutive TP ranks: TP rank r holds query heads [r*H/tp, (r+1)*H/tp) and kv head
r // (tp/kv_heads), which is the kv head all of those query heads attend with. A DTensor
cannot be replicated over part of its mesh dimension, so the k and v projections stay plain
tensors holding the rank's head (`ReplicatedHeadsColwise`, a torch ParallelStyle), and the
two sums Megatron-LM does for such heads are explicit:

- the attention input's gradient: each rank's k/v path contributes only through its own
  query heads, so it is a partial sum over tp, added to the query path's (a DTensor
  `Partial`) and all-reduced once with it at the attention input;
- the k/v weights' gradients: summed over the tp/kv_heads ranks sharing a head
  (`head_groups`, one group per (pp, dp, head)) before the optimizer, as the two copies of
  a tied embedding are, so the replicas take identical steps and stay identical.
"""
from __future__ import annotations

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from parallelism.layout.placement import Placement
from parallelism.layout.tensors import TensorSpec


def is_replicated(tensor: TensorSpec, tp: int) -> bool:
    """A tensor whose tp-split units (heads) are fewer than tp: each unit on tp/units ranks."""
    return tensor.split.tp_units is not None and tensor.split.tp_units < tp


def replicated_units(placement: Placement, module: str = "llm") -> int | None:
    """The unit count (kv heads) of the module's replicated tensors, None when there are none."""
    tp = placement.modules[module].tp
    units = {t.split.tp_units for t in placement.model.tensors if t.split.module == module and is_replicated(t, tp)}
    if len(units) > 1:
        raise ValueError(f"{placement.model.name}: replicated tensors with different unit counts {sorted(units)}")
    return units.pop() if units else None


def head_groups(ranks: Tensor, units: int):
    """The groups of ranks sharing a kv head, from the (pp, dp, tp) rank grid: ranks
    [u*r, (u+1)*r) of every TP group, r = tp/units. Collective over the default group:
    every process builds all of them (torch's new_subgroups_by_enumeration) and gets its own."""
    pp, dp, tp = ranks.shape
    share = tp // units
    groups = [[int(v) for v in ranks[p, d, u * share:(u + 1) * share]]
              for p in range(pp) for d in range(dp) for u in range(units)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return group


def copy_to_heads(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """x (replicated over the tp mesh) as a local tensor whose gradient is a partial sum over
    tp: the replicated projection's contribution joins the other heads' before the one
    all-reduce (Megatron's "copy to tensor-parallel region")."""
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x.to_local(grad_placements=[Partial()])


class ReplicatedHeadsColwise(ParallelStyle):
    """Column-parallel by heads when the heads (`units`) are fewer than tp: the module keeps
    plain parameters holding the rank's head, rows [u*n, (u+1)*n) of dim 0 for head
    u = tp_rank // (tp/units), and takes its input through `copy_to_heads`."""

    def __init__(self, units: int) -> None:
        super().__init__()
        self.units = units

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"ReplicatedHeadsColwise applies to nn.Linear, not {type(module).__name__}")
        tp = device_mesh.size()
        if tp % self.units:
            raise ValueError(f"{self.units} heads cannot be replicated evenly over tp={tp}")
        unit = device_mesh.get_local_rank() // (tp // self.units)
        for name, p in list(module.named_parameters(recurse=False)):
            rows = p.shape[0] // self.units
            local = p.detach().narrow(0, unit * rows, rows).clone()
            module.register_parameter(name, nn.Parameter(local, requires_grad=p.requires_grad))
        module.register_forward_pre_hook(lambda _, args: (copy_to_heads(args[0], device_mesh), *args[1:]))
        return module
