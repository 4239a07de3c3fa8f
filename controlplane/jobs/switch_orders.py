"""A resize's switch orders: one per node of the union world (its staying, joining and leaving
processes), sent after commit; a node the broker cannot reach aborts the resize and the job
trains on (issue 43)."""
from __future__ import annotations

import logging
from collections import defaultdict

from django.conf import settings
from django.db import transaction
from kombu.exceptions import OperationalError

from agents import protocol
from controlplane.jobs import transitions
from controlplane.jobs.lifecycle import TransitionState
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.orders import dataset_directory, send, send_cancels_on_commit

log = logging.getLogger(__name__)


def switch_orders(job: Job, transition: Transition) -> dict[str, protocol.JobSwitchOrder]:
    """One order per node holding a staying, joining or leaving process: the same order
    except `ranks`, that node's processes in the union world (its old ranks and its joining
    processes)."""
    union = {slot["rank"]: slot for slot in transition.source_placement}
    process_of = transition.process_of
    for slot in transition.destination_placement:
        union.setdefault(slot["rank"] if process_of is None else process_of[slot["rank"]], slot)
    slots: dict[str, list[protocol.RankSlot]] = defaultdict(list)
    for rank in sorted(union):
        slot = union[rank]
        slots[slot["node"]].append(protocol.RankSlot(rank=rank, gpu=slot["gpu"]))
    return {node: protocol.JobSwitchOrder(
        job_id=job.pk, transition_id=transition.pk, job_name=job.name, model=job.model,
        global_batch=job.global_batch, micro_batch=job.micro_batch, seq=job.seq_len, max_steps=job.max_steps,
        src_layout=transition.source_layout, src_world=transition.source_world, layout=transition.destination_layout,
        world=transition.destination_world, rendezvous=transition.rendezvous, ranks=tuple(ranks),
        staging_bytes=transition.staging_bytes, gpus_per_node=transition.gpus_per_node,
        checkpoint_interval=job.checkpoint_interval, checkpoint_dir=job.checkpoint_dir, restore_id=job.restore_id,
        process_of=None if process_of is None else tuple(process_of), dataset=dataset_directory(job),
        eval_every=job.eval_every, eval_batches=job.eval_batches,
        step_timeout_seconds=settings.DYNAPLANE_STEP_TIMEOUT_SECONDS)
        for node, ranks in slots.items()}


def send_switches(job_id: int, orders: dict[str, protocol.JobSwitchOrder]) -> None:
    """After commit, each node its switch order. One the broker refuses aborts the resize with
    the reason and the job trains on in its layout (issue 43): a broker blip must not fail a
    training job; the nodes told already are told to drop it."""
    told: list[str] = []
    for node, order in orders.items():
        try:
            send(protocol.NODE_JOB_SWITCH, node, order)
        except (OperationalError, OSError) as exc:
            log.error("job %s: the switch order of transition %s to node %s not sent: %s", job_id,
                      order.transition_id, node, exc)
            _abort_undelivered(job_id, order.transition_id, f"the switch order to node {node} could not be sent "
                                                            f"({exc})", told)
            return
        told.append(node)


def _abort_undelivered(job_id: int, transition_id: int, why: str, told: list[str]) -> None:
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        row = transitions.active_transition(job, lock=True) if job is not None else None
        if row is None or row.pk != transition_id or row.state not in (TransitionState.PLANNED,
                                                                       TransitionState.PREPARING):
            log.info("job %s: transition %s has moved on; its reports end it", job_id, transition_id)
            return
        why = f"{why}; the job trains on in {job.layout}"
        transitions.abort(job, row, why)
        log.warning("job %s: transition %s aborted: %s", job.name, row.pk, why)
        if told:
            send_cancels_on_commit(job, told, protocol.JobSwitchCancel(job_id=job.pk, transition_id=row.pk, reason=why))
