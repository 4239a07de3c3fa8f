"""Closed event schemas of the cluster stream (nodes, GPUs, jobs) and the pure
snapshot arithmetic: apply_event(snapshot, event) -> snapshot."""
from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field, TypeAdapter

from controlplane.common.events import Closed, HelloEvent

STREAM = "cluster"
GROUP = "cluster"

NodeStateName = Literal["healthy", "lost"]
GpuStateName = Literal["free", "allocated", "draining", "lost"]


class NodeView(Closed):
    """What the live view shows of a node. Not the heartbeat time: steady heartbeats are
    silent, so a field that changes with every beat would break the snapshot invariant."""

    name: str
    host: str
    device: Literal["cpu", "cuda"]
    state: NodeStateName
    gpu_count: int
    gpu_memory_bytes: int
    # The host's CPU and memory as shown (changed only with an event: cluster/host_stats.py).
    cpu_percent: float | None = None
    cpu_count: int | None = None
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None


class GpuView(Closed):
    node: str
    index: int
    model_name: str
    memory_bytes: int
    state: GpuStateName
    job: str | None

    @property
    def key(self) -> str:
        return f"{self.node}/{self.index}"


class JobView(Closed):
    """What the live lists show of a job, elastic settings included (the jobs list's
    "Elastic range" and "Priority" cells follow them without a reload)."""

    id: int
    name: str
    model: str
    layout: str
    state: str
    gpus: int
    elastic: bool = False
    min_gpus: int | None = None  # None: follows the job's size (gpus)
    max_gpus: int | None = None
    priority: int = 0
    queued: bool = False  # pending, for the elastic scheduler to start


class NodeEvent(Closed):
    type: Literal["node"] = "node"
    op: Literal["upsert"] = "upsert"
    seq: int
    node: NodeView


class GpuEvent(Closed):
    type: Literal["gpu"] = "gpu"
    op: Literal["upsert"] = "upsert"
    seq: int
    gpu: GpuView


class JobEvent(Closed):
    type: Literal["job"] = "job"
    op: Literal["upsert", "remove"]
    seq: int
    job: JobView



ClusterEvent = Annotated[Union[NodeEvent, GpuEvent, JobEvent, HelloEvent], Field(discriminator="type")]
cluster_event_adapter: TypeAdapter = TypeAdapter(ClusterEvent)


class ClusterSnapshot(Closed):
    seq: int
    nodes: tuple[NodeView, ...]
    gpus: tuple[GpuView, ...]
    jobs: tuple[JobView, ...]

    def canonical(self) -> dict:
        """Order-independent form, for comparing snapshots."""
        return {
            "nodes": {n.name: n.model_dump() for n in self.nodes},
            "gpus": {g.key: g.model_dump() for g in self.gpus},
            "jobs": {j.id: j.model_dump() for j in self.jobs},
        }


def apply_event(snapshot: ClusterSnapshot, event: NodeEvent | GpuEvent | JobEvent | HelloEvent) -> ClusterSnapshot:
    """The snapshot after one event; events at or below the snapshot's seq are ignored
    (they are already in it). This is what the browser does, in Python."""
    if isinstance(event, HelloEvent) or event.seq <= snapshot.seq:
        return snapshot
    nodes, gpus, jobs = snapshot.nodes, snapshot.gpus, snapshot.jobs
    if isinstance(event, NodeEvent):
        nodes = tuple(n for n in nodes if n.name != event.node.name) + (event.node,)
    elif isinstance(event, GpuEvent):
        gpus = tuple(g for g in gpus if g.key != event.gpu.key) + (event.gpu,)
    elif isinstance(event, JobEvent):
        jobs = tuple(j for j in jobs if j.id != event.job.id)
        if event.op == "upsert":
            jobs += (event.job,)
    return ClusterSnapshot(seq=event.seq, nodes=nodes, gpus=gpus, jobs=jobs)
