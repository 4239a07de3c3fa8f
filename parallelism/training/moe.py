"""Mixture-of-experts MLP: a router and SwiGLU experts stored as 3-D [experts, ...] tensors, top-k routing."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ExpertWeight(nn.Module):
    """One stacked expert tensor as a module's `weight`, so its name reads `moe.experts.gate.weight`."""

    def __init__(self, shape: tuple[int, ...], fk: dict[str, Any]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, **fk))


class Experts(nn.Module):
    """E SwiGLU experts: gate and up [E, F, H], down [E, H, F] (each expert's slice is an nn.Linear weight).

    Keeping them stacked (rather than E separate Linears) gives the catalog's one logical tensor per kind,
    which EP splits along dim 0 and TP along the FFN dimension.
    """

    def __init__(self, experts: int, hidden: int, ffn: int, fk: dict[str, Any]) -> None:
        super().__init__()
        self.gate = ExpertWeight((experts, ffn, hidden), fk)
        self.up = ExpertWeight((experts, ffn, hidden), fk)
        self.down = ExpertWeight((experts, hidden, ffn), fk)

    def forward(self, x: Tensor, expert: int) -> Tensor:
        """Expert `expert` applied to the tokens x [n, H] routed to it."""
        h = F.silu(F.linear(x, self.gate.weight[expert])) * F.linear(x, self.up.weight[expert])
        return F.linear(h, self.down.weight[expert])


class MoE(nn.Module):
    """Top-k routing: softmax over all experts, keep the k best, renormalize their gates to sum to 1 (Qwen3/Mixtral).

    With top_k == 1 the renormalized gate is always 1 and the router gets no gradient (as in Mixtral's
    formulation); the catalog's MoE models use top_k >= 2. No load-balancing loss is added here.
    """

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int, fk: dict[str, Any]) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"MoE needs 1 <= top_k <= experts, got top_k={top_k}, experts={experts}")
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False, **fk)
        self.experts = Experts(experts, hidden, ffn, fk)

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = F.softmax(self.router(flat).float(), dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)  # [N, k] each
        gates = (top / top.sum(-1, keepdim=True)).to(x.dtype)
        # Group the N*k (token, expert) assignments by expert with one sort and one host sync (the counts),
        # instead of a nonzero() per expert.
        assignment = chosen.reshape(-1)
        order = assignment.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(assignment, minlength=self.num_experts).tolist()
        routed = flat[tokens]
        parts, start = [], 0
        for expert, n in enumerate(counts):
            if n:
                parts.append(self.experts(routed[start:start + n], expert))
            start += n
        weighted = torch.cat(parts) * gates.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add_(0, tokens, weighted).view_as(x)
