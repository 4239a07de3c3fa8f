"""Reads of the inventory: view models, the snapshot, counts for health."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from django.apps import apps
from django.db import transaction
from django.db.models import Count, Min, Q

from controlplane.cluster.events import STREAM, ClusterSnapshot, GpuView, JobView, NodeView
from controlplane.cluster.lifecycle import GpuState, NodeState
from controlplane.cluster.models import Gpu, Node
from controlplane.common.errors import Conflict
from controlplane.common.events import current_seq

T = TypeVar("T")


def node_view(node: Node) -> NodeView:
    return NodeView(
        name=node.name, host=node.host, device=node.device, state=node.state,
        gpu_count=node.gpu_count, gpu_memory_bytes=node.gpu_memory_bytes, cpu_percent=node.cpu_percent,
        cpu_count=node.cpu_count, memory_used_bytes=node.memory_used_bytes, memory_total_bytes=node.memory_total_bytes,
    )


def gpu_view(gpu: Gpu) -> GpuView:
    return GpuView(
        node=gpu.node.name, index=gpu.index, model_name=gpu.model_name, memory_bytes=gpu.memory_bytes,
        state=gpu.state, job=gpu.job.name if gpu.job_id else None,
    )


def job_view(job) -> JobView:
    return JobView(id=job.id, name=job.name, model=job.model, layout=job.layout, state=job.state, gpus=job.world_size,
                   elastic=job.elastic, min_gpus=job.min_gpus, max_gpus=job.max_gpus, priority=job.priority,
                   queued=job.queued)


def cluster_snapshot() -> ClusterSnapshot:
    """Everything the cluster page shows, with the seq it is consistent with. The seq is
    read first: an event racing the read is at worst applied twice (events carry whole
    objects, so that is harmless), never missed."""
    Job = apps.get_model("jobs", "Job")  # by name: the jobs app builds on this one, never the reverse

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


def lost_nodes() -> list[tuple[str, object]]:
    """(name, last heartbeat or None) of every node marked lost, by name."""
    return list(Node.objects.filter(state=NodeState.LOST).order_by("name").values_list("name", "last_heartbeat"))


def inventory_capacity() -> tuple[int, int | None]:
    """(GPUs in the inventory, whatever their state; the smallest GPU's memory in bytes, None
    without GPUs): what a job may ask for at most."""
    got = Gpu.objects.aggregate(total=Count("id"), smallest=Min("memory_bytes"))
    return got["total"], got["smallest"]


def gpus_take(choose: Callable[[dict[str, list[int]]], tuple[T, list[tuple[str, int]]]],
              tries: int = 5) -> tuple[T, dict[tuple[str, int], Gpu]]:
    """Choose among the free GPUs of healthy nodes and lock the chosen rows (inside the caller's
    transaction): `choose(free)` gets node -> free indices (read without a lock) and returns
    (its result, the (node, index) pairs it takes); those rows are then locked in id order and
    must still be free, else another scheduler took one meanwhile and the choice is made again
    on a fresh read. Returns (the result, (node, index) -> the locked row).

    Optimistic: locking every free row first (what this replaced) read 8,192 rows as objects
    and serialized every start and grow behind it (0.64 s a start at 1,024 nodes)."""
    for _ in range(tries):
        free: dict[str, list[int]] = {}
        ids: dict[tuple[str, int], int] = {}
        for pk, node, index in (Gpu.objects.filter(state=GpuState.FREE, job__isnull=True,
                                                   node__state=NodeState.HEALTHY)
                                .order_by("id").values_list("id", "node__name", "index")):
            free.setdefault(node, []).append(index)
            ids[(node, index)] = pk
        result, wanted = choose(free)
        chosen = [ids[pair] for pair in wanted]
        rows = list(Gpu.objects.select_for_update(of=("self",)).select_related("node")
                    .filter(pk__in=chosen, state=GpuState.FREE, job__isnull=True, node__state=NodeState.HEALTHY)
                    .order_by("id"))
        if len(rows) == len(set(chosen)):
            return result, {(row.node.name, row.index): row for row in rows}
    raise Conflict(f"the free GPUs changed under {tries} tries to place on them; try again")


def gpus_per_node() -> int:
    """The largest node's GPU count (every node the inventory knows), for a switch's plan
    and its ranks: both must use the same value, or their plan fingerprints differ."""
    counts = Gpu.objects.values("node").annotate(n=Count("id")).values_list("n", flat=True)
    return max(counts, default=1) or 1
