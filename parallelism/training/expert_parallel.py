"""MoE layers on a layout: experts sharded over tp (the FFN dimension) and ep (the expert
dimension), the router replicated (docs/contracts.md section 2: gate/up tp_dim=1, down
tp_dim=2, ep_dim=0 for all three).

Tensor parallelism (Megatron-LM's MoE with TP): every TP rank routes the same tokens the same
way and runs its F/tp slice of each expert, so an expert's output is a partial sum over tp.
The whole MoE block is one tensor-parallel region: its input is entered with `copy` (identity
forward, all-reduce of the input gradient), its output left with `reduce` (all-reduce, or
reduce-scatter under sequence parallelism). Gating happens before that all-reduce, on the
partial outputs, so the router's gradient is a partial sum too: the router's TP replicas sum
their gradients before the optimizer (parallelism/training/ties.py), as a tied embedding's copies do.

Expert parallelism: the dp (x cp) ranks are cut into groups of ep consecutive data indices;
data index d holds experts [(d % ep) * E/ep, (d % ep + 1) * E/ep). Each rank routes its own
tokens, sends every (token, expert) row to the expert's owner in its ep group with one
all_to_all_single (split sizes from the router's counts, exchanged first), runs its experts
on what it receives and sends the outputs back the same way. An expert's gradient then holds
the contributions of every rank of its ep group; the ranks holding the same experts (data
indices d, d + ep, ...: the expert-data-parallel group) sum theirs and every gradient is
divided by dp, as the dense parameters' average over dp is.
"""
from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from parallelism.layout.shards import chunk
from parallelism.training.moe import MoE, Experts, run_grouped


class ParallelDispatch:
    """A MoE layer's experts sharded over `tp_mesh` (None: tp=1) and the ep group (`ep` ranks,
    None: ep=1). `sequence_parallel`: the block's input and output are split over the
    sequence across tp (Shard(1)), as the dense MLP's are."""

    def __init__(self, tp_mesh: DeviceMesh | None, sequence_parallel: bool, ep_group, ep: int) -> None:
        self.tp_mesh, self.sequence_parallel, self.ep_group, self.ep = tp_mesh, sequence_parallel, ep_group, ep

    def enter(self, x: Tensor) -> Tensor:
        """The block's input, replicated over tp, as a local tensor whose gradient is a
        partial sum over tp (all-reduced, or reduce-scattered under sequence parallelism, on
        its way back)."""
        if self.tp_mesh is None:
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return x.to_local(grad_placements=[Partial()])

    def leave(self, y: Tensor) -> Tensor:
        """The partial sums over tp, summed: all-reduce, or reduce-scatter over the sequence."""
        if self.tp_mesh is None:
            return y
        target = Shard(1) if self.sequence_parallel else Replicate()
        return DTensor.from_local(y, self.tp_mesh, [Partial()], run_check=False).redistribute(
            self.tp_mesh, [target]).to_local()

    def run(self, experts: Experts, routed: Tensor, counts: list[int]) -> Tensor:
        """routed [n, H]: the rows for every expert of the model, grouped by expert (counts[e]
        rows for expert e). Returns their outputs in the same order."""
        if self.ep == 1:
            return run_grouped(experts, routed, counts)
        local = len(counts) // self.ep
        received_counts = self._exchange_counts(counts, local, routed.device)
        send = [sum(counts[r * local:(r + 1) * local]) for r in range(self.ep)]
        receive = [sum(row) for row in received_counts]
        received = funcol.all_to_all_single_autograd(routed, receive, send, self.ep_group)
        # Gather the received rows expert by expert, run them, put them back in the received order.
        index = torch.tensor(expert_major(received_counts), dtype=torch.long, device=routed.device)
        per_expert = [sum(row[e] for row in received_counts) for e in range(local)]
        out = run_grouped(experts, received[index], per_expert)
        back = out.new_zeros(out.shape).index_copy(0, index, out)
        return funcol.all_to_all_single_autograd(back, send, receive, self.ep_group)

    def _exchange_counts(self, counts: list[int], local: int, device) -> list[list[int]]:
        """[source][local expert]: the rows each rank of the ep group sends to our experts."""
        sent = torch.tensor(counts, dtype=torch.long, device=device)
        got = funcol.all_to_all_single(sent, None, None, self.ep_group)
        if is_fake(sent):  # traced without values: every source's counts are this rank's (balanced)
            return [counts[:local] for _ in range(self.ep)]
        return got.wait().view(self.ep, local).tolist()


def expert_major(counts: list[list[int]]) -> list[int]:
    """counts[s][e]: rows source s sent for local expert e; the rows arrive source by source,
    each source's in expert order. Returns the row indices grouped by expert (sources in
    order within an expert), the order the experts run them in."""
    starts, offset = [], 0
    for row in counts:
        starts.append([])
        for n in row:
            starts[-1].append(offset)
            offset += n
    experts = len(counts[0]) if counts else 0
    return [i for e in range(experts) for s, row in enumerate(counts)
            for i in range(starts[s][e], starts[s][e] + row[e])]


def _narrowed(p: nn.Parameter, dims: dict[int, tuple[int, int]]) -> nn.Parameter:
    t = p.detach()
    for dim, (lo, hi) in dims.items():
        t = t.narrow(dim, lo, hi - lo)
    return nn.Parameter(t.clone(), requires_grad=p.requires_grad)


def shard_experts(moe: MoE, *, tp_rank: int, tp: int, ep_rank: int, ep: int) -> None:
    """Keep the rank's box of each expert tensor as a plain parameter: experts
    [ep_rank*E/ep, (ep_rank+1)*E/ep) and the tp rank's torch.chunk of the FFN dimension
    (dim 1 of gate/up, dim 2 of down), the boxes parallelism/layout/shards.py gives the rank."""
    per = moe.num_experts // ep
    experts = (ep_rank * per, (ep_rank + 1) * per)
    for name, ffn_dim in (("gate", 1), ("up", 1), ("down", 2)):
        holder = getattr(moe.experts, name)
        lo, hi = chunk(holder.weight.shape[ffn_dim], tp, tp_rank)
        holder.weight = _narrowed(holder.weight, {0: experts, ffn_dim: (int(lo), int(hi))})
        if holder.bias is not None:  # gate/up biases [E, F] split like their rows; down's [E, H] whole
            holder.bias = _narrowed(holder.bias, {0: experts, **({1: (int(lo), int(hi))} if name != "down" else {})})
    moe.experts.down_bias_share = 1.0 if tp_rank == 0 else 0.0


def parallelize_moe(stage: nn.Module, *, tp_mesh: DeviceMesh | None, sequence_parallel: bool, ep_group, ep: int,
                    ep_rank: int) -> list[str]:
    """Shard every MoE layer of `stage` for the rank and give it a ParallelDispatch; returns
    the names of the tensors replicated over tp whose gradients are partial sums there: the
    routers' (and their biases) and the experts' down-projection biases (rank 0 adds them)."""
    tp = tp_mesh.size() if tp_mesh is not None else 1
    tp_rank = tp_mesh.get_local_rank() if tp_mesh is not None else 0
    routers = []
    for name, module in stage.named_modules():
        if isinstance(module, MoE):
            shard_experts(module, tp_rank=tp_rank, tp=tp, ep_rank=ep_rank, ep=ep)
            module.dispatch = ParallelDispatch(tp_mesh, sequence_parallel, ep_group, ep)
            routers.append(f"{name}.router.weight")
            if module.router.bias is not None:
                routers += [f"{name}.router.bias", f"{name}.experts.down.bias"]
    return routers
