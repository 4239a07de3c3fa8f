"""How the tracer records the program's gradient accumulation (torch side): a steady-state
micro-batch, and its accumulation ops tagged (trace.ComputeOp.role)."""
from __future__ import annotations

import torch

from parallelism.emulator.recorder import OpRecorder


def hold_accumulated_grads(optimizer, micro_batches: int, recorder: OpRecorder, names: set[str] | None = None) -> None:
    """Trace a steady-state micro-batch: with more than one per step, most backwards add
    into fp32 gradient buffers that earlier micro-batches filled (ShardedAdamW.accumulate's
    in-place add, 10 bytes a parameter) rather than creating them (the first one's copy, 6).
    The buffers (of the slots in `names`, all by default) are made outside the recording,
    then counted as live from here on. FSDP2 (zero=3) keeps no such buffers: nothing to do."""
    slots = [s for s in getattr(optimizer, "slots", None) or () if names is None or s.name in names]
    if micro_batches < 2 or not slots:
        return
    recorder.suspended += 1
    try:
        for slot in slots:
            slot.grad = torch.zeros(slot.local.shape, dtype=torch.float32)
    finally:
        recorder.suspended -= 1
    for slot in slots:
        recorder.track(slot.grad)


def tag_accumulation(optimizer, recorder: OpRecorder) -> None:
    """Tag the ops of ShardedAdamW.accumulate (a micro-batch's gradient into its fp32 buffer)
    "grad_accumulate", so a run whose weight-gradient GEMMs accumulate in place can drop them
    (grad_accumulation.py). FSDP2 (zero=3) reduce-scatters instead: nothing to tag."""
    if not hasattr(optimizer, "slots"):
        return
    accumulate = optimizer.accumulate

    def tagged(slot, grad) -> None:
        recorder.role = "grad_accumulate"
        try:
            accumulate(slot, grad)
        finally:
            recorder.role = ""

    optimizer.accumulate = tagged  # this traced instance only
