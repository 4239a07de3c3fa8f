"""Writes to the inventory: heartbeats (registration, inventory, recovery), the sweep
that marks silent nodes lost, and GPUs given to and taken back from jobs. Each change
emits one event on the cluster stream. The jobs app builds on this one, never the reverse."""
from __future__ import annotations

import logging
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from agents.protocol import AgentHeartbeat
from controlplane.cluster.events import GROUP, STREAM, GpuEvent, NodeEvent
from controlplane.cluster.host_stats import Shown, worth_showing
from controlplane.cluster.lifecycle import GpuState, GpuTrigger, NodeState, gpu_next_state, node_next_state
from controlplane.cluster.liveness import kept_since, last_heard
from controlplane.cluster.models import Gpu, Node
from controlplane.cluster.selectors import gpu_view, node_view
from controlplane.common.events import next_seq, publish_on_commit

log = logging.getLogger(__name__)


def _emit_node(node: Node) -> None:
    publish_on_commit(GROUP, NodeEvent(seq=next_seq(STREAM), node=node_view(node)))


def _emit_gpu(gpu: Gpu) -> None:
    publish_on_commit(GROUP, GpuEvent(seq=next_seq(STREAM), gpu=gpu_view(gpu)))


def _set_gpu_state(gpu: Gpu, trigger: GpuTrigger) -> None:
    new = gpu_next_state(GpuState(gpu.state), trigger, held_by_job=gpu.job_id is not None)
    if new != gpu.state:
        gpu.state = new
        gpu.save(update_fields=["state"])
        _emit_gpu(gpu)


def node_record_heartbeat(*, report: AgentHeartbeat, received_at: datetime | None = None, key_id: str = "") -> Node:
    """Register or refresh a node from its agent's heartbeat.

    New node: created with its GPUs (free). Known node: inventory updated; a lost node
    comes back healthy and its GPUs return to free/allocated; GPUs no longer reported are
    marked lost. Only changes emit events (a steady heartbeat is silent).
    """
    now = received_at or timezone.now()
    with transaction.atomic():
        node, created = Node.objects.select_for_update().get_or_create(
            name=report.node, defaults={"host": report.host, "device": report.device}
        )
        was = (node.state, node.host, node.device, node.gpu_count, node.gpu_memory_bytes)
        if not created and node.state == NodeState.HEALTHY and (node.host, node.agent_pid) != (report.host, report.pid):
            # A restart looks the same, but then the old agent has stopped beating; two
            # live agents with one name make the node flap between them, so say so.
            log.warning("node %s: heartbeat from agent pid %s on %s, previous one from pid %s on %s; "
                        "if both are running, give them different --name", node.name, report.pid, report.host,
                        node.agent_pid, node.host)
        came_back = node.state == NodeState.LOST
        if created or came_back:  # (the elastic scheduler grows jobs onto a node that joined)
            node.joined_at = now
        node.host, node.device = report.host, report.device
        node.state = node_next_state(NodeState(node.state), heartbeat_fresh=True)
        node.last_heartbeat = now
        node.agent_pid, node.agent_started_at = report.pid, report.started_at
        node.gpu_count = len(report.gpus)
        node.gpu_memory_bytes = sum(g.memory_bytes for g in report.gpus)
        node.running_jobs = {str(job.job_id): list(job.ranks) for job in report.jobs}
        node.running_emulations = list(report.emulations)
        node.key_id = key_id or node.key_id
        stats_shown = _show_host_stats(node, report, now)
        node.save()
        if created or stats_shown or was != (node.state, node.host, node.device, node.gpu_count, node.gpu_memory_bytes):
            _emit_node(node)
        if came_back:
            log.info("node %s is back (pid %s)", node.name, report.pid)

        if not created and not came_back and _steady(node, report):
            return node  # (the common case: no GPU objects built, nothing else written)
        known = {g.index: g for g in node.gpus.select_related("job")}
        for reported in report.gpus:
            gpu = known.pop(reported.index, None)
            if gpu is None:
                gpu = Gpu.objects.create(
                    node=node, index=reported.index, uuid=reported.uuid, model_name=reported.model_name,
                    memory_bytes=reported.memory_bytes, state=GpuState.FREE,
                )
                _emit_gpu(gpu)
                continue
            changed = (gpu.model_name, gpu.memory_bytes, gpu.uuid) != (
                reported.model_name, reported.memory_bytes, reported.uuid
            )
            gpu.model_name, gpu.memory_bytes, gpu.uuid = reported.model_name, reported.memory_bytes, reported.uuid
            if changed:
                gpu.save(update_fields=["model_name", "memory_bytes", "uuid"])
            if came_back or gpu.state == GpuState.LOST:
                _set_gpu_state(gpu, GpuTrigger.NODE_BACK)
            elif changed:
                _emit_gpu(gpu)
        for missing in known.values():  # the agent no longer reports these devices
            _set_gpu_state(missing, GpuTrigger.NODE_LOST)
    return node


def _show_host_stats(node: Node, report: AgentHeartbeat, now: datetime) -> bool:
    """Put the reported host stats on the node if they are worth an event (host_stats.py)."""
    stats = report.host_stats
    reported = Shown(stats.cpu_percent, stats.cpu_count, stats.memory_used_bytes,
                     stats.memory_total_bytes) if stats is not None else None
    shown = Shown(node.cpu_percent, node.cpu_count, node.memory_used_bytes,
                  node.memory_total_bytes) if node.host_stats_at is not None else None
    since = (now - node.host_stats_at).total_seconds() if node.host_stats_at is not None else None
    if not worth_showing(shown, reported, since):
        return False
    node.cpu_percent, node.cpu_count = reported.cpu_percent, reported.cpu_count
    node.memory_used_bytes, node.memory_total_bytes = reported.memory_used_bytes, reported.memory_total_bytes
    node.host_stats_at = now
    return True


def _steady(node: Node, report: AgentHeartbeat) -> bool:
    """Whether the node's GPUs are exactly the reported ones, none lost: then a heartbeat
    changes nothing about them. One light query (64 nodes beat every 2 s: this is the
    control worker's most frequent task)."""
    stored = {index: (model_name, memory, uuid) for index, model_name, memory, uuid, state in
              node.gpus.values_list("index", "model_name", "memory_bytes", "uuid", "state") if state != GpuState.LOST}
    return stored == {g.index: (g.model_name, g.memory_bytes, g.uuid) for g in report.gpus}


def nodes_mark_lost(*, silent_for: timedelta, now: datetime | None = None) -> list[str]:
    """Mark nodes not heard for `silent_for` lost, with their GPUs. Returns the names of the
    nodes that were newly lost. What that means for the jobs on them is the jobs app's
    (jobs/node_loss.py composes both in one transaction).

    Heard: the row's last_heartbeat (written when a heartbeat changed the node) or, later, the
    agent's last post to Redis (liveness.py); a node Redis has no post of is silent only if Redis
    has kept liveness for the whole silence (it may have restarted or been flushed meanwhile).
    Only the silent ones are locked."""
    cutoff = (now or timezone.now()) - silent_for
    quiet = list(Node.objects.filter(state=NodeState.HEALTHY, last_heartbeat__lt=cutoff).values_list("name", flat=True))
    heard = last_heard(quiet)
    if len(heard) < len(quiet) and kept_since() >= cutoff:
        heard = {name: heard.get(name, cutoff) for name in quiet}  # Redis lost what it heard lately: not silent
    silent = [name for name in quiet if name not in heard or heard[name] < cutoff]
    lost = []
    if not silent:
        return lost
    with transaction.atomic():
        for node in Node.objects.select_for_update().filter(name__in=silent, state=NodeState.HEALTHY,
                                                            last_heartbeat__lt=cutoff):
            node.state = node_next_state(NodeState(node.state), heartbeat_fresh=False)
            node.save(update_fields=["state"])
            _emit_node(node)
            for gpu in node.gpus.select_related("job"):
                _set_gpu_state(gpu, GpuTrigger.NODE_LOST)
            lost.append(node.name)
    for name in lost:
        log.warning("node %s lost: no heartbeat for %.1f s", name, silent_for.total_seconds())
    return lost


def gpus_allocate(*, gpus: list[Gpu], job) -> None:
    """Give these GPU rows (locked, free: selectors.gpus_take) to `job`."""
    for gpu in gpus:
        gpu.job = job
        gpu.state = gpu_next_state(GpuState(gpu.state), GpuTrigger.ALLOCATE)
        gpu.save(update_fields=["job", "state"])
        _emit_gpu(gpu)


def gpus_release(*, gpus) -> None:
    """Detach GPUs from their job: allocated/draining ones become free, lost ones stay lost."""
    for gpu in gpus.select_related("node", "job").select_for_update(of=("self",)):
        gpu.job = None
        gpu.state = gpu_next_state(GpuState(gpu.state), GpuTrigger.RELEASE)
        gpu.save(update_fields=["job", "state"])
        _emit_gpu(gpu)
