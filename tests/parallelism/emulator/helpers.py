"""Small trace builders: stages whose forward/backward take exact, chosen seconds."""
from __future__ import annotations

from dataclasses import replace

from parallelism.emulator.devices import get_profile
from parallelism.emulator.trace import ComputeOp, StageMemory, StageTrace, Trace

# An H100 without launch gaps: a memory op of `s * memory_bandwidth` bytes takes exactly s seconds.
PROFILE = replace(get_profile("h100"), launch_seconds=0.0)


def timed(name: str, seconds: float, kind: str = "memory") -> ComputeOp:
    if kind == "memory":
        return ComputeOp(name, "memory", 0.0, seconds * PROFILE.memory_bandwidth)
    # an attention op without shape runs at attention_fraction of peak
    return ComputeOp(name, kind, seconds * PROFILE.peak("bf16") * PROFILE.attention_fraction, 0.0)


def stage(index: int, forward=1.0, backward=2.0, memory: StageMemory | None = None, **kwargs) -> StageTrace:
    """forward/backward: seconds of one op, or the ops themselves."""
    if isinstance(forward, (int, float)):
        forward = (timed("f", forward),)
    if isinstance(backward, (int, float)):
        backward = (timed("b", backward),)
    fields = dict(forward=forward, backward=backward, optimizer=(),
                  grad_sync=(), param_sync=(), memory=memory or StageMemory(10, 20, 30, 100, 7))
    fields.update(kwargs)
    return StageTrace(index, **fields)


def uniform_trace(pp: int, m: int, vpp: int = 1, forward: float = 1.0, backward: float = 2.0, **kwargs) -> Trace:
    """pp*vpp identical stages, each chunk 1/vpp of a stage's work, no communication."""
    stages = [stage(i, forward / vpp, backward / vpp) for i in range(pp * vpp)]
    return Trace("test", tp=1, pp=pp, dp=1, micro_batches=m, micro_batch_size=1, seq=16, stages=stages,
                 vpp=vpp, **kwargs)


def with_stages(trace: Trace, stages) -> Trace:
    return replace(trace, stages=tuple(stages))
