"""ShardedAdamW.accumulate: one pass a micro-batch, the same bits as adding fp32 copies."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from parallelism.training.zero import ShardedAdamW


def test_in_place_accumulation_matches_adding_fp32_copies_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(257, 33, generator=generator).mul(10 ** i).to(torch.bfloat16) for i in range(-3, 3)]
    slot = SimpleNamespace(grad=None)
    for g in grads:
        ShardedAdamW.accumulate(None, slot, g)
    expected = grads[0].float().clone()
    for g in grads[1:]:
        expected.add_(g.float())
    assert slot.grad.dtype == torch.float32
    assert torch.equal(slot.grad, expected)


def test_the_first_gradient_is_copied_not_aliased():
    g = torch.ones(4, dtype=torch.float32)  # an fp32 gradient (zero=3's, or an fp32 run's)
    slot = SimpleNamespace(grad=None)
    ShardedAdamW.accumulate(None, slot, g)
    ShardedAdamW.accumulate(None, slot, g)
    assert torch.equal(g, torch.ones(4)) and torch.equal(slot.grad, torch.full((4,), 2.0))
