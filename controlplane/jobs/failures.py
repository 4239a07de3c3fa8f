"""Ending a job that cannot go on: stop or fail it, free its GPUs, tell its nodes; and the
orders whose refusal by the broker fails the job (some nodes may have got theirs, and
there is no order that takes them back). Below every module that fails jobs."""
from __future__ import annotations

import logging

from django.db import transaction
from kombu.exceptions import OperationalError

from agents import protocol
from controlplane.cluster.models import Gpu
from controlplane.cluster.services import gpus_release
from controlplane.jobs import transitions
from controlplane.jobs.lifecycle import LIVE_JOB_STATES, JobState, JobTrigger, job_next_state
from controlplane.jobs.models import Job
from controlplane.jobs.orders import Order, send, stop_on_commit
from controlplane.jobs.services import publish_job

log = logging.getLogger(__name__)


def job_finish(job: Job, *, state: JobState, error: str = "") -> None:
    """Move a locked live job to stopped or failed and free its GPUs (lost ones stay lost).
    An active transition of the job ends aborted first (transitions.end_with_job)."""
    transitions.end_with_job(job, state=state, error=error)
    job.state = state
    if error:
        job.error = error
    job.save(update_fields=["state", "error", "updated_at"])
    gpus_release(gpus=Gpu.objects.filter(job=job))
    publish_job(job, "upsert")


def job_fail(*, job_id: int, error: str, notify: list[str] | None = None) -> Job | None:
    """Fail a live job, release its GPUs and tell its nodes (`notify`, default all, the nodes
    of joining ranks during a transition included) to stop."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.state not in LIVE_JOB_STATES:
            return job
        nodes = transitions.job_nodes(job) if notify is None else notify
        job_finish(job, state=job_next_state(JobState(job.state), JobTrigger.FAIL), error=error)
        stop_on_commit(job, nodes)
    return job


def send_orders_or_fail(job_id: int, task: str, orders: dict[str, Order], what: str) -> None:
    """After commit: each node its order. A broker that refuses one fails the job."""
    for node, order in orders.items():
        try:
            send(task, node, order)
        except (OperationalError, OSError) as exc:
            log.error("job %s: %s to node %s not sent: %s", job_id, what, node, exc)
            job_fail(job_id=job_id, error=f"{what} to node {node} could not be sent: {exc}")
            return


def send_starts_on_commit(job: Job, orders: dict[str, protocol.JobStartOrder]) -> None:
    """After commit, each node its start order; a refused one fails the job (its other
    nodes are told to stop) rather than leaving it starting for ever."""
    job_id = job.pk
    for node, order in orders.items():
        transaction.on_commit(lambda node=node, order=order: send_orders_or_fail(
            job_id, protocol.NODE_JOB_START, {node: order}, "the start order"))
