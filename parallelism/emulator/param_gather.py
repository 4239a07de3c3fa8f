"""When a run's data-parallel parameter all-gathers run, applied to a traced step (pure: no torch).

With ZeRO-1/2 (Megatron-Core's distributed optimizer) each rank steps its shard of the fp32
masters, then the updated bf16 parameters are all-gathered over the data-parallel ranks. The
traced program gathers them after its optimizer, exposed ("step"). Megatron-Core with
`overlap_param_gather` (NeMo's recipes set it) issues the gathers at the step's end and has
each layer's forward of the next step wait for its bucket only, so they run beside the next
step's first micro-batch ("overlapped"): simulate.py starts them on the DP stream at the
step's start and ends a chunk's first forward no earlier than its gathers.
"""
from __future__ import annotations

import dataclasses

from parallelism.emulator.errors import require
from parallelism.emulator.trace import Trace

PARAM_GATHERS = ("step", "overlapped")


def with_param_gather(trace: Trace, mode: str) -> Trace:
    require(mode in PARAM_GATHERS, f"param_gather={mode!r} not in {PARAM_GATHERS}")
    return dataclasses.replace(trace, param_gather_overlapped=True) if mode == "overlapped" else trace
