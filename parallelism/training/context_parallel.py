"""Context parallelism (cp > 1): each sequence cut into cp contiguous chunks, chunk c on the
rank with cp_rank c (docs/contracts.md section 2: d = cp_rank + cp*dp_rank; the planner's
activation split, parallelism/planner/activations.py, cuts the tokens the same way).

Every layer but attention is position-wise, so it runs on the rank's chunk as it is. In
attention the chunk's queries need the keys and values of every earlier position: each rank
all-gathers K and V over its cp group (a functional collective whose backward is a
reduce-scatter, so every chunk's K/V gradient gathers the contributions of the later chunks'
queries) and keeps the positions up to its chunk's end; the causal mask is then aligned to the
bottom right (query i of chunk c sees keys 0 .. c*T/cp + i). Positions (RoPE tables, learned
position rows) start at the chunk's offset c*T/cp.

Why an all-gather rather than torch's context_parallel (ring attention): torch's ring
attention rotates K/V shards with its own SDPA kernels (flash / efficient / cuDNN), which
exist for CUDA only; on gloo and CPU (and in the emulator's fake mode) the all-gather with
plain SDPA is the same mathematics. The all-gather's memory is the full sequence's K/V per
layer, as Megatron-LM's all-gather CP variant and Llama 3's training (Dubey et al. 2024,
section 3.3.2) keep it; K/V are a fraction of the activations with grouped-query attention.

Parameters and optimizer state see cp as more data parallelism: the planner replicates (or
ZeRO-chunks) every tensor over dp x cp, each rank's loss is the mean over its chunk's tokens
(all chunks equally long), and the gradients are averaged over dp x cp, which is the
single-rank run's mean over the global batch's tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes

from parallelism.training.layers import Attention


@dataclass(frozen=True, eq=False)
class ContextShard:
    """This rank's place in its cp group: chunk `index` of `size`, `group` the ranks holding
    the other chunks of the same sequences."""

    group: object  # ProcessGroup of the cp ranks, in cp_rank order
    size: int
    index: int

    def start(self, local_length: int) -> int:
        """The first position of this rank's chunk, given the chunk's length."""
        return self.index * local_length

    def attend(self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool, enable_gqa: bool) -> Tensor:
        """Attention of the chunk's queries [B, heads, T/cp, d] over the keys/values of the
        whole sequence (gathered from the cp ranks), causal over global positions."""
        local = q.shape[2]
        k = funcol.all_gather_single(k.contiguous(), 2, self.group)
        v = funcol.all_gather_single(v.contiguous(), 2, self.group)
        if not causal:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
        end = self.start(local) + local  # later positions are masked: leave them out
        k, v = k[:, :, :end], v[:, :, :end]
        if end == local:  # the first chunk: the ordinary causal mask
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
        # torch's CausalBias: flash kernels take it without a materialized [T/cp, end] mask. It
        # holds no data and is built outside any dispatch mode (the emulator's FakeTensorMode
        # and recorder), which cannot back a tensor subclass; attention under them still runs.
        with _disable_current_modes():
            mask = causal_lower_right(local, end)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def split_sequence(tokens: Tensor, targets: Tensor, shard: ContextShard) -> tuple[Tensor, Tensor]:
    """The rank's chunk of a batch's tokens and targets [B, T]."""
    length = tokens.shape[1]
    if length % shard.size:
        raise ValueError(f"context parallelism splits the sequence over cp={shard.size}: seq {length} is not "
                         f"a multiple of {shard.size}")
    local = length // shard.size
    lo = shard.start(local)
    return tokens[:, lo:lo + local], targets[:, lo:lo + local]


def parallelize_context(stage: nn.Module, shard: ContextShard) -> None:
    """Make every attention module of `stage` attend over the gathered sequence and the
    stage offset its positions (DecoderStage.context)."""
    for module in stage.modules():
        if isinstance(module, Attention):
            module.context = shard
    stage.context = shard


def context_group(ranks: Tensor, cp: int):
    """The cp group of this process (None where it holds no chunk), from a layout's ranks
    [pp, dp*cp, tp] (the data index d = cp_rank + cp*dp_rank): the cp consecutive data indices
    of each dp replica at the same pp and tp coordinates. Collective over the default group:
    every process calls it alike."""
    pp, data, tp = ranks.shape
    grid = ranks.view(pp, data // cp, cp, tp)
    groups = [[int(r) for r in grid[p, d, :, t]] for p in range(pp) for d in range(data // cp) for t in range(tp)]
    group, _ = dist.new_subgroups_by_enumeration(groups)
    return group
