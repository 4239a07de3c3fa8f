"""Mixture-of-experts MLP: a router and SwiGLU experts stored as 3-D [experts, ...] tensors, top-k routing.

Where the experts run is the module's `dispatch`: `LocalDispatch` here (every expert on this
rank, whole), or parallelism/training/expert_parallel.py's `ParallelDispatch` (experts sharded
over tp along the FFN dimension and over ep along the expert dimension, tokens sent to
their experts' owners with all-to-all). The routing, gating and combining are the same code
either way, so a parallel run computes what a single rank does.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import is_fake


class ExpertWeight(nn.Module):
    """One stacked expert tensor as a module's `weight`, so its name reads `moe.experts.gate.weight`;
    with `bias` its per-expert bias [E, out] (GPT-OSS's experts) as `moe.experts.gate.bias`."""

    def __init__(self, shape: tuple[int, ...], fk: dict[str, Any], bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, **fk))
        self.bias = nn.Parameter(torch.empty(shape[:2], **fk)) if bias else None


class Experts(nn.Module):
    """E SwiGLU experts: gate and up [E, F, H], down [E, H, F] (each expert's slice is an nn.Linear weight).

    Keeping them stacked (rather than E separate Linears) gives the catalog's one logical tensor per kind,
    which EP splits along dim 0 and TP along the FFN dimension. Under EP the module holds the
    rank's experts only, indexed from 0.
    """

    def __init__(self, experts: int, hidden: int, ffn: int, fk: dict[str, Any],
                 act: Callable[[Tensor], Tensor] = F.silu, *, bias: bool = False,
                 glu: Callable[[Tensor, Tensor], Tensor] | None = None) -> None:
        super().__init__()
        self.act = act
        self.glu = glu or (lambda gate, up: self.act(gate) * up)
        self.gate = ExpertWeight((experts, ffn, hidden), fk, bias)
        self.up = ExpertWeight((experts, ffn, hidden), fk, bias)
        self.down = ExpertWeight((experts, hidden, ffn), fk, bias)
        # The down projection's bias is added once: under tp every rank's output is a partial sum
        # (expert_parallel.py), so only tp rank 0 adds it (its share, 1 or 0).
        self.down_bias_share = 1.0

    def _linear(self, x: Tensor, holder: ExpertWeight, expert: int) -> Tensor:
        return F.linear(x, holder.weight[expert], None if holder.bias is None else holder.bias[expert])

    def forward(self, x: Tensor, expert: int) -> Tensor:
        """Expert `expert` (this module's index) applied to the tokens x [n, H] routed to it."""
        h = self.glu(self._linear(x, self.gate, expert), self._linear(x, self.up, expert))
        out = F.linear(h, self.down.weight[expert])
        if self.down.bias is not None:
            out = out + self.down.bias[expert] * self.down_bias_share
        return out


def clamped_swiglu(limit: float, alpha: float) -> Callable[[Tensor, Tensor], Tensor]:
    """GPT-OSS's expert activation: (up + 1) * gate * sigmoid(alpha * gate), gate clamped from
    above and up from both sides at `limit`."""
    def glu(gate: Tensor, up: Tensor) -> Tensor:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return glu


def run_grouped(experts: Experts, x: Tensor, counts: list[int]) -> Tensor:
    """x [sum(counts), H] grouped by expert (counts[e] rows for expert e, in order) through its
    experts. Every expert runs, an empty group too, so each expert weight is in the graph
    (a zero gradient rather than none, whatever the routing)."""
    parts, start = [], 0
    for expert, n in enumerate(counts):
        parts.append(experts(x[start:start + n], expert))
        start += n
    return torch.cat(parts)


def balanced_counts(n: int, experts: int) -> list[int]:
    """n assignments spread as evenly as they go over `experts` (the first n % experts one more)."""
    base, extra = divmod(n, experts)
    return [base + (1 if e < extra else 0) for e in range(experts)]


def expert_counts(assignment: Tensor, experts: int) -> list[int]:
    """Assignments per expert. On fake tensors (the emulator traces this program without
    values) the routing is unknown and taken as balanced, the load an auxiliary-loss-trained
    router aims at."""
    if is_fake(assignment):
        return balanced_counts(assignment.numel(), experts)
    return torch.bincount(assignment, minlength=experts).tolist()


class LocalDispatch:
    """All the experts on this rank, whole: the single-rank program."""

    def enter(self, x: Tensor) -> Tensor:
        return x

    def run(self, experts: Experts, routed: Tensor, counts: list[int]) -> Tensor:
        return run_grouped(experts, routed, counts)

    def leave(self, y: Tensor) -> Tensor:
        return y


class MoE(nn.Module):
    """Top-k routing: softmax over all experts, keep the k best, renormalize their gates to sum to 1
    (Mixtral's rule; Qwen3-MoE's with norm_topk_prob, which without it keeps the softmax values).

    With top_k == 1 the renormalized gate is always 1 and the router gets no gradient (as in Mixtral's
    formulation); the catalog's MoE models use top_k >= 2. No load-balancing loss is added here.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, fk: dict[str, Any], *,
                 norm_topk_prob: bool = True, act: Callable[[Tensor], Tensor] = F.silu, bias: bool = False,
                 glu: Callable[[Tensor, Tensor], Tensor] | None = None) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoE needs 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
        self.num_experts, self.top_k, self.norm_topk_prob = experts, top_k, norm_topk_prob
        self.router = nn.Linear(hidden, experts, bias=bias, **fk)
        self.experts = Experts(experts, hidden, ffn, fk, act, bias=bias, glu=glu)
        self.dispatch: Any = LocalDispatch()

    def route(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """(gates, chosen experts), each [N, k], of the tokens flat [N, H]."""
        probs = F.softmax(self.router(flat).float(), dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return top.to(flat.dtype), chosen

    def forward(self, x: Tensor) -> Tensor:
        x = self.dispatch.enter(x)
        flat = x.reshape(-1, x.shape[-1])
        gates, chosen = self.route(flat)
        # Group the N*k (token, expert) assignments by expert with one sort and one host sync (the counts),
        # instead of a nonzero() per expert.
        assignment = chosen.reshape(-1)
        order = assignment.argsort(stable=True)
        tokens = order // self.top_k
        counts = expert_counts(assignment, self.num_experts)
        out = self.dispatch.run(self.experts, flat[tokens], counts)
        weighted = out * gates.reshape(-1)[order, None]
        return self.dispatch.leave(torch.zeros_like(flat).index_add_(0, tokens, weighted).view_as(x))
