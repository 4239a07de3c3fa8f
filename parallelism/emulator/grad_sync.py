"""When a run reduces its data-parallel gradients, applied to a traced step (pure: no torch).

The traced program (ShardedAdamW.step, ZeRO 0-2) reduces its gradients in the optimizer
step, after the rank's last backward of every chunk it holds: nothing hides behind compute.
Other frameworks reduce as the backward produces the gradients, in buckets, on a stream of
their own beside the last micro-batch's backward: PyTorch DDP (Li et al. 2020, "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB; buckets of
bucket_cap_mb = 25 MB by default) and FSDP (its per-module reduce-scatter in the backward).
Megatron-LM's "local" DDP of 2021-22 reduced after the backward, as the program does.

- "program": the trace as the program runs it (ZeRO-3 reduces each micro-batch in its backward).
- "step": every bucket after the rank's last backward.
- "overlapped": each reduction split into buckets of at most BUCKET_BYTES, issued evenly
  through the last micro-batch's backward; only what outlasts the backward is exposed.
"""
from __future__ import annotations

import dataclasses
import math

from parallelism.emulator.errors import require
from parallelism.emulator.trace import CommOp, StageTrace, Trace
from parallelism.emulator.trace_edit import each_stage

GRAD_SYNCS = ("program", "step", "overlapped")
BUCKET_BYTES = 25 * 2**20


def with_grad_sync(trace: Trace, mode: str) -> Trace:
    require(mode in GRAD_SYNCS, f"grad_sync={mode!r} not in {GRAD_SYNCS}")
    return trace if mode == "program" else each_stage(trace, lambda stage: _stage(stage, mode))


def _stage(stage: StageTrace, mode: str) -> StageTrace:
    if not stage.grad_sync or stage.grad_sync_each_microbatch:  # ZeRO-3 reduces every micro-batch already
        return stage
    n_back = len(stage.backward)
    if mode == "step":
        return dataclasses.replace(stage, grad_sync_in_step=True, grad_sync_after=(n_back,) * len(stage.grad_sync))
    buckets = tuple(piece for op in stage.grad_sync for piece in buckets_of(op))
    k = len(buckets)
    return dataclasses.replace(stage, grad_sync=buckets, grad_sync_in_step=False,
                               grad_sync_after=tuple(round((i + 1) * n_back / k) for i in range(k)))


def buckets_of(op: CommOp, cap: float = BUCKET_BYTES) -> tuple[CommOp, ...]:
    """The reduction as equal buckets of at most `cap` bytes (same group, same kind)."""
    k = max(1, math.ceil(op.bytes / cap))
    return tuple(dataclasses.replace(op, bytes=op.bytes / k) for _ in range(k))
