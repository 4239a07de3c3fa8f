"""zero=3 with FSDP2 (`fully_shard`): every state of a parameter, the bf16 `param` too, is
cut along dim 0 of the rank's tensor-parallel box into dp parts (docs/contracts.md section 2),
which is exactly how FSDP2 shards a parameter (torch.chunk on dim 0, on top of TP).

FSDP2 keeps the sharded parameter in fp32, so the sharded parameter *is* the `master`;
MixedPrecisionPolicy all-gathers it as bf16 for compute and reduce-scatters gradients in
fp32. The `param` state is then bf16(master), the same relation the zero<3 path keeps
after every step, so handing over and taking back state loses nothing.
"""
from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from parallelism.training.moe import MoE
from parallelism.training.ties import sum_over_groups

State = tuple[Tensor, Tensor, Tensor, Tensor]  # param, master, exp_avg, exp_avg_sq (local boxes)


class FullyShardedState:
    """Shards `stage` (already tensor-parallel, fp32 on the meta device) over `dp_mesh`,
    materializes it from the given masters and runs AdamW on the shards."""

    def __init__(self, stage: nn.Module, dp_mesh: DeviceMesh, device: torch.device, state: dict[str, State], *,
                 lr: float, weight_decay: float, step: int, rank: int, ties: dict[str, object] | None = None,
                 roots: list[nn.Module] | None = None, experts: DeviceMesh | None = None,
                 blocks: list[nn.Module] | None = None, grad_scale: float = 1.0) -> None:
        """`ties`: {parameter name: group} of weights whose copies on the group's other ranks
        take the sum of their gradients (ShardedAdamW's); the copies hold the same dp shard.
        `roots`: the modules the pipeline runs, sharded as FSDP roots (an interleaved
        pipeline's virtual stages), else `stage` itself. `experts`: under expert parallelism,
        the ranks holding the same experts (parallelism/training/expert_parallel.py): each MoE
        layer's experts are sharded over them, their gradients summed there and divided by dp.
        `blocks`: the modules sharded one by one (each all-gathered only while it runs), by
        default the decoder's layers `stage.llm.layers` (a ViT encoder passes its own).
        `grad_scale`: a factor on the (dp-averaged) gradients before the step (the
        multimodal trainer's encoder, parallelism/training/hetero.py)."""
        self.ties, self.grad_scale = ties or {}, grad_scale
        # FSDP2 warns when a wrapped module returns a view (the TP head's replicated logits):
        # harmless here, nothing modifies a stage's output in place.
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        # The parameters are still on the meta device here. fully_shard's mesh bookkeeping runs
        # real tensor ops (nonzero), which a FakeTensorMode (the emulator's tracer) cannot.
        with unset_fake_temporarily():
            if experts is not None:
                for module in stage.modules():
                    if isinstance(module, MoE):
                        fully_shard(module.experts, mesh=experts, mp_policy=policy)
                        module.experts.set_gradient_divide_factor(float(dp_mesh.size()))
                        # Sum, then divide: gloo has no PREMUL_SUM, what a custom factor uses otherwise. Not on
                        # one rank, where FSDP2 (torch 2.13) divides by the factor as it copies, then again after.
                        module.experts.set_force_sum_reduction_for_comms(experts.size() > 1)
            for layer in (blocks if blocks is not None else stage.llm.layers.values()):
                fully_shard(layer, mesh=dp_mesh, mp_policy=policy)
            for root in roots or [stage]:
                fully_shard(root, mesh=dp_mesh, mp_policy=policy)
        stage.to_empty(device=device)
        self.stage = stage
        self.params: dict[str, nn.Parameter] = dict(stage.named_parameters())
        with torch.no_grad():
            for name, p in self.params.items():
                local = p.to_local()
                master = state[name][1]
                if tuple(master.shape) != tuple(local.shape):
                    raise ValueError(f"rank {rank}: {name} master box {tuple(master.shape)} does not match "
                                     f"the FSDP shard {tuple(local.shape)}")
                local.copy_(master)
        decay = [p for p in self.params.values() if p.dim() >= 2]
        no_decay = [p for p in self.params.values() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=lr, betas=(0.9, 0.95), eps=1e-8, fused=True)
        for name, p in self.params.items():
            _, _, exp_avg, exp_avg_sq = state[name]
            # The fused kernel takes its step count on the parameters' device.
            self.optimizer.state[p] = {"step": torch.tensor(float(step), device=device), "exp_avg": _like(p, exp_avg),
                                       "exp_avg_sq": _like(p, exp_avg_sq)}

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        tied = []
        for name, group in self.ties.items():
            p = self.params[name]
            if p.grad is None:
                p.grad = _like(p, torch.zeros_like(p.to_local()))
            tied.append((p.grad.to_local(), group))
        sum_over_groups(tied)
        if self.grad_scale != 1.0:
            for p in self.params.values():
                if p.grad is not None:
                    p.grad.mul_(self.grad_scale)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def hand_over(self) -> dict[str, State]:
        out = {}
        for name, p in self.params.items():
            state = self.optimizer.state[p]
            master = p.detach().to_local()
            out[name] = (master.to(torch.bfloat16), master, state["exp_avg"].to_local(), state["exp_avg_sq"].to_local())
        self.params, self.optimizer, self.stage = {}, None, None
        return out


def _like(p: DTensor, local: Tensor) -> DTensor:
    return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
