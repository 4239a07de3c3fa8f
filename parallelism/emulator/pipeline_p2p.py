"""How a run moves activations between pipeline stages, applied to a traced step (pure: no
torch).

The traced program sends each stage's output asynchronously (torch.distributed.pipelining):
the sender goes on computing; the receiver waits only for the bytes. Megatron-LM in 2021-22
(megatron/p2p_communication.py, `_communicate`) exchanged synchronously: `batch_isend_irecv`,
a wait on every request and a `torch.cuda.synchronize()` after it, so the sender is busy for
its send too; and with tensor parallelism it used the scatter-gather optimization of
Narayanan et al. 2021 (section 4.1): each of the t ranks of a stage sends 1/t of the
activations over its own NIC, and the receiving ranks all-gather them over NVLink. With
sequence parallelism the activations are already the rank's 1/t slice: no gather.

- "program": as traced.
- "megatron": sends of 1/t of the bytes, an all-gather over the tensor-parallel group at the
  start of the receiving stage's forward (backward), the sender blocked while it sends.
"""
from __future__ import annotations

import dataclasses

from parallelism.emulator.errors import require
from parallelism.emulator.stage_cost import RECEIVED_GATHER, is_p2p
from parallelism.emulator.trace import CommOp, Trace
from parallelism.emulator.trace_edit import expand_ops, with_ops

PIPELINE_P2PS = ("program", "megatron")


def with_pipeline_p2p(trace: Trace, mode: str, sequence_parallel: bool = False) -> Trace:
    require(mode in PIPELINE_P2PS, f"pipeline_p2p={mode!r} not in {PIPELINE_P2PS}")
    if mode == "program":
        return trace
    stages = list(trace.stages)
    if trace.tp > 1 and not sequence_parallel:
        stages = [_scatter_gather(stages, k, trace.tp) for k in range(len(stages))]
    return dataclasses.replace(trace, stages=tuple(stages), p2p_blocking=True)


def _scatter_gather(stages, k: int, tp: int):
    """Stage k's sends carry 1/tp of their bytes; what it receives is all-gathered first."""
    stage = stages[k]

    def split(op):
        return (dataclasses.replace(op, bytes=op.bytes / tp),)

    def gather_of(sender, phase: str):
        sends = [op for op in getattr(sender, phase) if is_p2p(op) and op.kind == "send"]
        return tuple(CommOp(RECEIVED_GATHER, "all_gather", op.bytes, tp, 1, "tp") for op in sends)

    forward = expand_ops(stage.forward, is_p2p, split)
    backward = expand_ops(stage.backward, is_p2p, split)
    received_fwd = gather_of(stages[k - 1], "forward") if k > 0 else ()
    received_bwd = gather_of(stages[k + 1], "backward") if k + 1 < len(stages) else ()
    forward = _prepend(forward, received_fwd)
    backward = _prepend(backward, received_bwd)
    return with_ops(stage, forward=forward, backward=backward)


def _prepend(expanded, ops):
    """expand_ops' result with `ops` in front (positions shift by their count)."""
    new, at = expanded
    return tuple(ops) + new, [i + len(ops) for i in at]
