"""Zero-filled tensors whose memory the OS provides on first write, as calloc does.

A rank's Adam moments start at zero and are first written by the optimizer's first step;
torch.optim's own Adam creates them only then. `initial_shards` and the Hugging Face load
hand the trainer its moments up front (the switch engine and checkpoints move them as any
state), so they are made here from an anonymous private mapping: reading it gives zeros
from the kernel's shared zero page, and only the pages the first step writes are faulted in,
by that step. Zero-filling them at load time instead was half of a 1.1B load's first-touch
page faults (docs/benchmarks.md, "HF weights").
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import torch
from torch import Tensor

MIN_BYTES = 1 << 20  # below this a mapping of its own is not worth it: zero-filled by torch


def untouched_zeros(shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """A contiguous CPU tensor of zeros whose pages are not touched until written."""
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if size < MIN_BYTES:
        return torch.zeros(tuple(shape), dtype=dtype)
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(buffer, dtype=dtype).view(tuple(shape))  # the tensor keeps the mapping alive
