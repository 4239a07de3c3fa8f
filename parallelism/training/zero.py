"""Mixed-precision AdamW for the replicated / ZeRO-1/2 data-parallel path.

Every rank keeps its tensor-parallel box of each parameter in bf16 (the `param` state,
replicated over data parallelism) and, for a chunk of that box, the fp32 `master` and
Adam's `exp_avg` / `exp_avg_sq`: with zero >= 1 the chunk is part d of D = dp along dim 0
(torch.chunk semantics, as docs/contracts.md section 2 says); with zero=0 it is the whole box.

A step: the fp32 gradients (accumulated over micro-batches by the trainer) are averaged
over the data-parallel group in one flat all-reduce, each rank updates its chunk with
torch.optim.AdamW, casts it to bf16 and the chunks are all-gathered back into every
rank's bf16 box (one flat all-gather). zero=2 keeps the same state as zero=1 (it only
shards gradients, which are not training state) and runs the same way here.

The update is torch's fused AdamW (one kernel reads the master, gradient and both moments
and writes them back), as Megatron's apex FusedAdam is, not the foreach one (a kernel per
pass, about four times the memory traffic). On a CPU the foreach step of 24.6M parameters
took 780 ms against 55 ms fused (one thread), and its square root runs 2.5-6.5x slower on
exact zeros, which an embedding's second moment holds in every row no batch has reached yet
(docs/benchmarks.md, "Emulator against real CPU runs": "What changed: the program's optimizer").

Why not FSDP2 for these stages: fully_shard always shards the parameter itself (ZeRO-3);
with zero < 3 the contract has each rank hold the whole bf16 box, which is this path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from parallelism.layout.shards import chunk
from parallelism.training.ties import sum_over_groups


@dataclass(frozen=True, eq=False)
class Replicas:
    """The ranks holding the same box of some parameters: their gradients are summed over
    `group` and ZeRO cuts their masters into `size` chunks over it. Experts under expert
    parallelism have their own (the ranks holding the same experts, parallelism/training/
    expert_parallel.py); every other parameter the optimizer's data-parallel group."""

    group: object | None  # None: one rank
    size: int


@dataclass
class ParamSlot:
    """One parameter as the optimizer sees it."""

    name: str
    local: Tensor       # the rank's bf16 tensor-parallel box (a view of the live parameter)
    rows: tuple[int, int]  # the master chunk's rows of that box
    master: Tensor      # fp32 [rows, ...]
    grad: Tensor | None = None  # fp32, the whole box, accumulated over micro-batches
    replicas: Replicas | None = None  # None: the optimizer's data-parallel group


def chunk_rows(n: int, parts: int, index: int) -> tuple[int, int]:
    lo, hi = chunk(n, parts, index)
    return int(lo), int(hi)


class ShardedAdamW:
    """AdamW over the masters of `slots`; `group` is the data-parallel process group (or
    None when dp == 1). `ties`: {parameter name: group}: weights whose copies on the
    group's other ranks (a tied embedding's, on the other end stage of the pipeline; a kv
    head replicated over TP ranks, parallelism/training/kv_heads.py) take the sum of their
    gradients before the data-parallel average. Slots with their own `replicas` (experts
    under expert parallelism) are summed over those instead; every gradient is divided by
    dp, since an expert's already holds the tokens of its ep group's ranks."""

    def __init__(self, slots: list[ParamSlot], group, dp: int, *, lr: float, betas=(0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, moments: dict[str, tuple[Tensor, Tensor]] | None = None,
                 step: int = 0, ties: dict[str, object] | None = None) -> None:
        self.slots, self.group, self.dp, self.ties = slots, group, dp, ties or {}
        self.default = Replicas(group, dp)
        self.updating = False
        decay = [s.master for s in slots if s.master.dim() >= 2]
        no_decay = [s.master for s in slots if s.master.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}],
                                           lr=lr, betas=betas, eps=eps, fused=True)
        moments = moments or {}
        for s in slots:  # state up front: it is training state a switch moves, even before step 1
            exp_avg, exp_avg_sq = moments.get(s.name) or (torch.zeros_like(s.master), torch.zeros_like(s.master))
            self.optimizer.state[s.master] = {"step": torch.tensor(float(step), device=s.master.device), "exp_avg": exp_avg,
                                              "exp_avg_sq": exp_avg_sq}

    def moments(self, slot: ParamSlot) -> tuple[Tensor, Tensor]:
        state = self.optimizer.state[slot.master]
        return state["exp_avg"], state["exp_avg_sq"]

    def hand_over(self) -> dict[str, tuple[Tensor, Tensor, Tensor, Tensor]]:
        """(param, master, exp_avg, exp_avg_sq) by name; drops every reference this holds."""
        out = {s.name: (s.local, s.master, *self.moments(s)) for s in self.slots}
        self.slots, self.optimizer = [], None
        return out

    def accumulate(self, slot: ParamSlot, grad: Tensor) -> None:
        """One pass over the box per micro-batch: the first gradient is copied into a new fp32
        buffer, later ones are added into it in place, the add promoting bf16 to fp32 itself
        (exact, so the sum is bit-identical to adding `grad.float()`, without its temporary: 10
        bytes a parameter instead of 18; Megatron's main_grad accumulation does the same)."""
        if slot.grad is None:
            slot.grad = grad.to(torch.float32, copy=True)
        else:
            slot.grad.add_(grad)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for s in self.slots:
            if s.grad is None:
                s.grad = torch.zeros(s.local.shape)
        if self.ties:
            sum_over_groups([(s.grad, self.ties[s.name]) for s in self.slots if s.name in self.ties])
        buckets = self._buckets()
        for replicas, slots in buckets:
            grads = [s.grad for s in slots]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if replicas.size > 1:
                dist.all_reduce(flat, group=replicas.group)
            if self.dp > 1:
                flat.div_(self.dp)
            offset = 0
            for s, g in zip(slots, grads):
                full = flat[offset:offset + g.numel()].view(g.shape)
                offset += g.numel()
                s.master.grad = full[s.rows[0]:s.rows[1]].clone()
            del flat
        self.updating = True  # until _publish is done: the masters move before the parameters
        for s in self.slots:
            s.grad = None
        self.optimizer.step()
        for s in self.slots:
            s.master.grad = None
        for replicas, slots in buckets:
            self._publish(replicas, slots)
        self.updating = False

    def _buckets(self) -> list[tuple[Replicas, list[ParamSlot]]]:
        """The slots by replica set, the data-parallel group's first (the same order on every rank)."""
        out: dict[int, tuple[Replicas, list[ParamSlot]]] = {id(self.default): (self.default, [])}
        for s in self.slots:
            replicas = s.replicas or self.default
            out.setdefault(id(replicas), (replicas, []))[1].append(s)
        return [bucket for bucket in out.values() if bucket[1]]

    def _publish(self, replicas: Replicas, slots: list[ParamSlot]) -> None:
        """Cast every rank's updated chunk to bf16 and all-gather the chunks into the boxes."""
        dp, group = replicas.size, replicas.group
        if dp == 1 or all(s.rows == (0, s.local.shape[0]) for s in slots):
            for s in slots:
                s.local.copy_(s.master)
            return
        # One flat buffer: every parameter's chunk padded to ceil(rows / dp) rows, so that all
        # ranks' buffers have the same size and one all_gather moves everything.
        padded = [-(-s.local.shape[0] // dp) * (s.local.numel() // max(s.local.shape[0], 1)) for s in slots]
        mine = torch.zeros(sum(padded), dtype=torch.bfloat16)
        offset = 0
        for s, size in zip(slots, padded):
            mine[offset:offset + s.master.numel()] = s.master.reshape(-1)
            offset += size
        gathered = torch.empty(dp * mine.numel(), dtype=torch.bfloat16)
        dist.all_gather_single(gathered, mine, group=group)
        gathered = gathered.view(dp, mine.numel())
        offset = 0
        for s, size in zip(slots, padded):
            rows = s.local.shape[0]
            if rows:
                # Rank d's chunk is rows [d*c, (d+1)*c) padded to c rows (torch.chunk), so the
                # ranks' padded chunks stacked in rank order are the parameter's rows, then padding:
                # one copy per parameter, whatever the data-parallel size.
                c = -(-rows // dp)
                stacked = gathered[:, offset:offset + size].reshape(dp * c, -1)[:rows]
                s.local.copy_(stacked.view(s.local.shape))
            offset += size
