"""The jobs app's floor for talking to the node agents: rendezvous ports and addresses, the
tensor-parallel block a node must hold, the per-node start orders, and sending orders on
the nodes' queues. Nothing here changes a job's state: a refused order that must fail the
job goes through failures.py, which builds on this module.
"""
from __future__ import annotations

import logging
import socket
from collections import defaultdict

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from kombu.exceptions import OperationalError

from agents import protocol
from agents.seal import seal
from controlplane.cluster.agent_tokens import node_order_key
from controlplane.celery import app
from controlplane.common.errors import Conflict
from controlplane.common.weights import weights_directory
from controlplane.jobs.lifecycle import LIVE_JOB_STATES, TERMINAL_TRANSITION_STATES
from controlplane.jobs.models import Job, Transition

log = logging.getLogger(__name__)

Order = protocol.JobStartOrder | protocol.JobStopOrder | protocol.JobSwitchCancel | protocol.JobSwitchOrder \
    | protocol.JobRecoverOrder


def rendezvous_ports() -> range:
    """DYNAPLANE_RENDEZVOUS_PORTS, "first-last" (inclusive)."""
    text = settings.DYNAPLANE_RENDEZVOUS_PORTS
    first, sep, last = text.partition("-")
    try:
        ports = range(int(first), int(last if sep else first) + 1)
    except ValueError:
        ports = range(0)
    if not ports or ports.start < 1 or ports.stop > 65536:
        raise ImproperlyConfigured(f"DYNAPLANE_RENDEZVOUS_PORTS={text!r} is not a port range like 29400-29599")
    return ports


def _local(host: str) -> bool:
    """Is `host` this machine? (Where the control plane can see whether a port is taken.)"""
    if host in ("localhost", "127.0.0.1", "::1", "[::1]", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return any(a.startswith("127.") or a == "::1" for a in addresses)


def port_taken_here(port: int) -> bool:
    """Does a process of this machine hold `port`? (A bind on every interface fails, as rank
    0's TCPStore would.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def free_port(host: str | None = None) -> int:
    """The lowest port of the range that no live job uses and no active transition (a
    resize's union world) uses, and, when rank 0's `host` is this machine, that no other
    process here holds (a second stack on the same machine made every job fail to
    rendezvous). Called with the free GPU rows locked, so two schedulers never read the same
    set (and unique constraints back this up within each table).

    A live job keeps every port it has had: its rank 0 process served the start store and
    each switch's union store, and torch keeps a store's socket open as long as anything in
    the process refers to it (measured: the start port was still bound after two switches,
    and a resize given it failed with EADDRINUSE). The ports come back when the job ends."""
    ports = rendezvous_ports()
    used = set(Job.objects.filter(state__in=LIVE_JOB_STATES, rendezvous_port__isnull=False)
               .values_list("rendezvous_port", flat=True))
    used |= set(Transition.objects.exclude(state__in=[s.value for s in TERMINAL_TRANSITION_STATES])
                .filter(rendezvous_port__isnull=False).values_list("rendezvous_port", flat=True))
    used |= set(Transition.objects.filter(job__state__in=LIVE_JOB_STATES, rendezvous_port__isnull=False)
                .values_list("rendezvous_port", flat=True))
    here = host is not None and _local(host)
    for port in ports:
        if port not in used and not (here and port_taken_here(port)):
            return port
    raise Conflict(f"all {len(ports)} rendezvous ports {ports.start}-{ports.stop - 1} are used by live jobs "
                   f"and active transitions" + (" or by other processes on this machine" if here else ""))


def rendezvous_address(host: str, port: int) -> str:
    """host:port, an IPv6 host in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def start_orders(job: Job) -> dict[str, protocol.JobStartOrder]:
    """One order per node of the job: the same job fields, that node's ranks only."""
    slots: dict[str, list[protocol.RankSlot]] = defaultdict(list)
    for slot in job.placement:
        slots[slot["node"]].append(protocol.RankSlot(rank=slot["rank"], gpu=slot["gpu"]))
    restore_from = job.checkpoint_path if job.restore_id else ""
    return {node: protocol.JobStartOrder(
        job_id=job.pk, job_name=job.name, model=job.model, layout=job.layout, world=job.world_size,
        global_batch=job.global_batch, micro_batch=job.micro_batch, seq=job.seq_len, rendezvous=job.rendezvous,
        ranks=tuple(ranks), max_steps=job.max_steps, checkpoint_interval=job.checkpoint_interval,
        checkpoint_dir=job.checkpoint_dir, restore_id=job.restore_id, restore_from=restore_from,
        dataset=dataset_directory(job), eval_every=job.eval_every, eval_batches=job.eval_batches,
        step_timeout_seconds=settings.DYNAPLANE_STEP_TIMEOUT_SECONDS,
        init_from="" if restore_from else initial_weights_directory(job))
        for node, ranks in slots.items()}


def dataset_directory(job: Job) -> str:
    """The absolute path of the job's dataset directory its ranks read ("": synthetic tokens):
    every order that starts ranks carries it (start, restore, the joining ranks of a switch)."""
    return job.dataset.directory if job.dataset_id is not None else ""


def initial_weights_directory(job: Job) -> str:
    """The absolute path of the Hugging Face model directory the job's ranks load their first
    state from ("": the seeded initialisation). Only a start that loads no checkpoint carries it:
    a restore (or a resume) has the trained state in its checkpoint."""
    return weights_directory(job.init_from) if job.init_from else ""


def send(task: str, node: str, order: Order) -> None:
    """One order on the node's queue now, sealed with the key the node's agent speaks with
    (agents/seal.py: the agent takes no order without it); the broker's refusal, or a node with
    no current key, is raised (OperationalError: the order cannot be delivered)."""
    body = order.model_dump(mode="json")
    key = node_order_key(node)
    if key is None:
        raise OperationalError(f"node {node} has no unrevoked agent key: its agent cannot be given orders")
    app.send_task(task, args=[body], kwargs={"seal": seal(key, node, task, body)}, queue=protocol.node_queue(node))


def _send_stops(job_id: int, nodes: list[str]) -> None:
    for node in nodes:
        try:
            send(protocol.NODE_JOB_STOP, node, protocol.JobStopOrder(job_id=job_id))
        except (OperationalError, OSError) as exc:  # the agent's ranks time out at the rendezvous/collectives
            log.error("job %s: stop order to node %s not sent: %s", job_id, node, exc)


def stop_on_commit(job: Job, nodes: list[str]) -> None:
    """After commit, tell these nodes to stop the job's ranks."""
    if nodes:
        nodes = list(nodes)
        transaction.on_commit(lambda: _send_stops(job.pk, nodes))


def send_cancels_on_commit(job: Job, nodes: list[str], cancel: protocol.JobSwitchCancel) -> None:
    """After commit, tell these nodes to drop the switch (joining ranks stopped, rank 0 told)."""
    nodes = list(nodes)
    transaction.on_commit(lambda: _send_cancels(job.pk, nodes, cancel))


def _send_cancels(job_id: int, nodes: list[str], cancel: protocol.JobSwitchCancel) -> None:
    for node in nodes:
        try:
            send(protocol.NODE_JOB_SWITCH_CANCEL, node, cancel)
        except (OperationalError, OSError) as exc:  # rank 0 then abandons the switch on its own timeout
            log.error("job %s: switch cancel to node %s not sent: %s", job_id, node, exc)
