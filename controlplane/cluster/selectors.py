"""Reads of the inventory: view models, the snapshot, counts for health."""
from __future__ import annotations

from django.db import transaction
from django.db.models import Count, Q

from controlplane.cluster.events import STREAM, ClusterSnapshot, GpuView, JobView, NodeView
from controlplane.cluster.lifecycle import GpuState, NodeState
from controlplane.cluster.models import Gpu, Node
from controlplane.common.events import current_seq


def node_view(node: Node) -> NodeView:
    return NodeView(
        name=node.name, host=node.host, device=node.device, state=node.state,
        gpu_count=node.gpu_count, gpu_memory_bytes=node.gpu_memory_bytes,
    )


def gpu_view(gpu: Gpu) -> GpuView:
    return GpuView(
        node=gpu.node.name, index=gpu.index, model_name=gpu.model_name, memory_bytes=gpu.memory_bytes,
        state=gpu.state, job=gpu.job.name if gpu.job_id else None,
    )


def job_view(job) -> JobView:
    return JobView(id=job.id, name=job.name, model=job.model, layout=job.layout, state=job.state, gpus=job.world_size)


def cluster_snapshot() -> ClusterSnapshot:
    """Everything the cluster page shows, with the seq it is consistent with. The seq is
    read first: an event racing the read is at worst applied twice (events carry whole
    objects, so that is harmless), never missed."""
    from controlplane.jobs.models import Job

    with transaction.atomic():
        seq = current_seq(STREAM)
        nodes = tuple(node_view(n) for n in Node.objects.all())
        gpus = tuple(gpu_view(g) for g in Gpu.objects.select_related("node", "job"))
        jobs = tuple(job_view(j) for j in Job.objects.order_by("id"))
    return ClusterSnapshot(seq=seq, nodes=nodes, gpus=gpus, jobs=jobs)


def inventory_counts() -> dict:
    nodes = Node.objects.aggregate(
        healthy=Count("id", filter=Q(state=NodeState.HEALTHY)), lost=Count("id", filter=Q(state=NodeState.LOST))
    )
    gpus = Gpu.objects.aggregate(total=Count("id"), **{s.value: Count("id", filter=Q(state=s)) for s in GpuState})
    return {"agents": nodes, "gpus": gpus}
