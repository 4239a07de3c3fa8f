"""untouched_zeros: zeros that cost no memory until written."""
from __future__ import annotations

import gc

import torch

from parallelism.engine.zero_pages import untouched_zeros


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_zeros_of_the_shape_and_dtype_that_take_memory_only_when_written() -> None:
    before = _rss()
    moments = untouched_zeros((64, 1 << 18), torch.float32)  # 64 MiB
    assert (moments.shape, moments.dtype, moments.is_contiguous()) == ((64, 1 << 18), torch.float32, True)
    assert torch.count_nonzero(moments) == 0  # reading maps the zero page: still nothing resident
    assert _rss() - before < (8 << 20)
    moments[:32].add_(1.5)  # the optimizer's first step writes them
    assert _rss() - before >= (30 << 20)
    assert moments[:32].eq(1.5).all() and moments[32:].eq(0).all()
    del moments
    gc.collect()
    assert _rss() - before < (8 << 20)  # the mapping goes with the tensor


def test_small_tensors_are_plain_zeros() -> None:
    small = untouched_zeros((3, 5), torch.bfloat16)
    assert small.dtype == torch.bfloat16 and torch.equal(small, torch.zeros(3, 5, dtype=torch.bfloat16))
    assert untouched_zeros((0, 7), torch.float32).shape == (0, 7)
