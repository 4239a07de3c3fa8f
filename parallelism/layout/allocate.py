"""Which GPU runs which rank: a layout's ranks placed on the free GPUs of a cluster.

Rules (pure, deterministic; the elastic manager of issue 6 calls this when it schedules a
job or a resize):
- a tensor-parallel group (tp consecutive ranks, docs/contracts.md section 2's rank order) never
  spans nodes: its all-reduces are on the critical path of every layer;
- ranks are placed in rank order, whole TP groups at a time, filling one node before the
  next, nodes with the most free GPUs first (ties by name): consecutive ranks, i.e. a
  stage's data-parallel replicas, share nodes, and pipeline stages (the slowest-varying
  coordinate, whose traffic is one activation per micro-batch) are what crosses nodes;
- a node's GPUs are taken in index order.
When the free GPUs cannot hold the layout, AllocationError says how many whole TP groups
are needed and how many fit.
"""
from __future__ import annotations

from dataclasses import dataclass

from parallelism.layout.errors import LayoutError


class AllocationError(LayoutError):
    """The free GPUs cannot hold the layout; the message gives the numbers."""


@dataclass(frozen=True)
class FreeGpus:
    node: str
    gpus: tuple[int, ...]  # free device indices on the node


@dataclass(frozen=True)
class Slot:
    rank: int
    node: str
    gpu: int


def allocate(world: int, tp: int, free: list[FreeGpus]) -> list[Slot]:
    """One slot per rank 0..world-1, TP groups of `tp` consecutive ranks on one node."""
    if tp < 1 or world < 1 or world % tp:
        raise AllocationError(f"world={world} must be a positive multiple of tp={tp}")
    groups = world // tp
    names = [f.node for f in free]
    if len(set(names)) != len(names):
        raise AllocationError(f"nodes listed twice: {sorted({n for n in names if names.count(n) > 1})}")
    nodes = sorted((f for f in free if f.gpus), key=lambda f: (-len(f.gpus), f.node))
    fits = sum(len(set(f.gpus)) // tp for f in nodes)
    if fits < groups:
        largest = max((len(set(f.gpus)) for f in nodes), default=0)
        raise AllocationError(
            f"{world} ranks need {groups} groups of tp={tp} GPUs on one node each; the free GPUs hold {fits} "
            f"(largest free block {largest} GPUs on one node, {sum(len(set(f.gpus)) for f in nodes)} free in all)")
    slots: list[Slot] = []
    rank = 0
    for node in nodes:
        gpus = sorted(set(node.gpus))
        for g in range(len(gpus) // tp):
            if rank == world:
                return slots
            slots += [Slot(rank + i, node.node, gpus[g * tp + i]) for i in range(tp)]
            rank += tp
    return slots
