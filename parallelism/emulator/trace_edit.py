"""Pure edits of a traced step that keep its positions right: how a run that differs from
the traced program (attention_kernels.py, grad_accumulation.py, grad_sync.py) rewrites it."""
from __future__ import annotations

import dataclasses
from typing import Callable

from parallelism.emulator.trace import Op, StageTrace, Trace


def each_stage(trace: Trace, edit: Callable[[StageTrace], StageTrace]) -> Trace:
    """The trace with `edit` applied to every pipeline stage and every input module's stage."""
    inputs = tuple(dataclasses.replace(item, stage=edit(item.stage)) for item in trace.inputs)
    return dataclasses.replace(trace, stages=tuple(edit(s) for s in trace.stages), inputs=inputs)


def expand_ops(ops: tuple[Op, ...], matches, replace) -> tuple[tuple[Op, ...], list[int]]:
    """ops with each op that `matches` replaced by the ops `replace` gives (none drops it);
    at[i] = the new position of old position i (i in 0..len, so "after the last op" maps too)."""
    out, at = [], []
    for op in ops:
        at.append(len(out))
        out.extend(replace(op) if matches(op) else (op,))
    at.append(len(out))
    return tuple(out), at


def with_ops(stage: StageTrace, forward: tuple[tuple[Op, ...], list[int]] | None = None,
             backward: tuple[tuple[Op, ...], list[int]] | None = None, **changes) -> StageTrace:
    """The stage with new forward / backward ops (each as expand_ops returns it), its
    gradient-sync and parameter-gather positions moved with them."""
    at = {"forward": forward[1] if forward else None, "backward": backward[1] if backward else None}
    phases = stage.phases() if stage.param_sync_at else ()
    moved = {}
    if at["backward"] is not None:
        moved["grad_sync_after"] = tuple(at["backward"][i] for i in stage.grad_sync_after)
        moved["backward"] = backward[0]
    if at["forward"] is not None:
        moved["forward"] = forward[0]
    moved["param_sync_at"] = tuple(at[p][i] if at.get(p) is not None else i
                                   for i, p in zip(stage.param_sync_at, phases))
    return dataclasses.replace(stage, **moved, **changes)
