"""Node and GPU lifecycles: documented enums and pure transition functions.

Node:  healthy --(heartbeats stop)--> lost --(heartbeat)--> healthy
GPU:   free --allocate--> allocated --drain--> draining --release--> free
       any --node_lost--> lost --node_back--> allocated (if a job holds it) | free
"""
from __future__ import annotations

from enum import StrEnum


class IllegalTransition(ValueError):
    """A trigger that the current state does not allow."""


class NodeState(StrEnum):
    HEALTHY = "healthy"
    LOST = "lost"


class GpuState(StrEnum):
    FREE = "free"
    ALLOCATED = "allocated"
    DRAINING = "draining"
    LOST = "lost"


class GpuTrigger(StrEnum):
    ALLOCATE = "allocate"
    DRAIN = "drain"
    RELEASE = "release"
    NODE_LOST = "node_lost"
    NODE_BACK = "node_back"


_GPU_EDGES: dict[tuple[GpuState, GpuTrigger], GpuState] = {
    (GpuState.FREE, GpuTrigger.ALLOCATE): GpuState.ALLOCATED,
    (GpuState.FREE, GpuTrigger.DRAIN): GpuState.DRAINING,
    (GpuState.ALLOCATED, GpuTrigger.DRAIN): GpuState.DRAINING,
    (GpuState.ALLOCATED, GpuTrigger.RELEASE): GpuState.FREE,
    (GpuState.DRAINING, GpuTrigger.RELEASE): GpuState.FREE,
    (GpuState.DRAINING, GpuTrigger.DRAIN): GpuState.DRAINING,
    (GpuState.LOST, GpuTrigger.RELEASE): GpuState.LOST,
    (GpuState.FREE, GpuTrigger.RELEASE): GpuState.FREE,
}


def gpu_next_state(state: GpuState, trigger: GpuTrigger, *, held_by_job: bool = False) -> GpuState:
    """The GPU's state after `trigger`; raises IllegalTransition when not allowed."""
    if trigger is GpuTrigger.NODE_LOST:
        return GpuState.LOST
    if trigger is GpuTrigger.NODE_BACK:
        if state is not GpuState.LOST:
            return state
        return GpuState.ALLOCATED if held_by_job else GpuState.FREE
    try:
        return _GPU_EDGES[(state, trigger)]
    except KeyError:
        raise IllegalTransition(f"GPU in state {state.value} cannot {trigger.value}") from None


def node_next_state(state: NodeState, *, heartbeat_fresh: bool) -> NodeState:
    """A node is healthy exactly while its heartbeats are fresh."""
    return NodeState.HEALTHY if heartbeat_fresh else NodeState.LOST
