"""Jobs on the node agents: allocate GPUs, pick a rendezvous, send start and stop orders.

Allocation is race-free: allocate() chooses among the free GPUs of healthy nodes, and the
chosen rows are then locked (SELECT ... FOR UPDATE, in id order) and must still be free, else
the choice is made again (cluster.selectors.gpus_take): a second scheduler that chose the same
rows waits for the first and then finds them taken. Orders leave after commit,
one per node, on that node's queue (orders.py; a refused one fails the job, failures.py).
"""
from __future__ import annotations

from django.db import transaction
from django.utils import timezone

from parallelism.layout.allocate import AllocationError, FreeGpus, allocate
from parallelism.layout.placement import batch_dp, tp_block
from controlplane.cluster.selectors import gpus_take
from controlplane.cluster.services import gpus_allocate
from controlplane.common import inputs
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.jobs import transitions
from controlplane.jobs.failures import job_finish
from controlplane.jobs.lifecycle import (STARTABLE_JOB_STATES, STOPPABLE_JOB_STATES, JobState, JobTrigger,
                                        job_next_state)
from controlplane.jobs.models import Job
from controlplane.jobs.orders import free_port, rendezvous_address, stop_on_commit
from controlplane.jobs.preflight import start_cancel, start_when_checked
from controlplane.jobs.resume import is_resume, resume_row
from controlplane.jobs.services import job_create, layout_check, publish_job


def job_submit(*, start: bool = True, queue: bool = False, **fields) -> Job:
    """POST /api/jobs: create the job and, when `start`, schedule it, all or nothing. With
    `queue` it stays pending and the elastic scheduler starts it (elastic_apply.py) as soon
    as its priority lets it: at once when its GPUs are free, else once elastic jobs of
    lower priority have shrunk for it or other jobs have ended."""
    with transaction.atomic():
        job = job_create(queued=queue, **fields)
        if start and not queue:
            job = job_start(job_id=job.pk)
    return job


def job_start(*, job_id: int) -> Job:
    """pending -> starting: allocate GPUs, store the placement and rendezvous, and on commit
    send each node its JobStartOrder (across hosts, after a pre-flight: preflight.py). Conflict (409) when the GPUs or ports are not there."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.state not in STARTABLE_JOB_STATES:
            raise Conflict(f"job {job.name!r} is {job.state}; only a pending job can be started")
        placement = layout_check(model=inputs.model_of(job.model), layout=job.layout)
        dp = batch_dp(placement)
        if job.global_batch % (job.micro_batch * dp):
            raise InvalidInput({"global_batch": [
                f"global_batch={job.global_batch} is not a multiple of micro_batch={job.micro_batch} x dp={dp}"]})
        def choose(free: dict[str, list[int]]):
            try:
                slots = allocate(placement.world, tp_block(placement),
                                 [FreeGpus(node, tuple(indices)) for node, indices in free.items()])
            except AllocationError as exc:
                raise Conflict(f"job {job.name!r} ({job.layout}) cannot be placed: {exc}") from None
            return slots, [(slot.node, slot.gpu) for slot in slots]

        slots, gpus = gpus_take(choose)
        gpus_allocate(gpus=[gpus[(slot.node, slot.gpu)] for slot in slots], job=job)
        port = free_port(gpus[(slots[0].node, slots[0].gpu)].node.host)
        job.placement = [{"rank": s.rank, "node": s.node, "gpu": s.gpu} for s in slots]
        job.rendezvous = rendezvous_address(gpus[(slots[0].node, slots[0].gpu)].node.host, port)
        job.rendezvous_port = port
        job.error = ""
        job.started_at = timezone.now()
        if is_resume(job):  # its ranks load the checkpoint (restore_from) and commit this row
            row = resume_row(job)
            job.restore_id = row.pk
            transitions.publish_transition(row)
        job.state = job_next_state(JobState.PENDING, JobTrigger.START)
        job.save()
        publish_job(job, "upsert")
        start_when_checked(job)  # (across hosts, a pre-flight first: preflight.py)
    return job


def job_stop(*, job_id: int) -> Job:
    """A pending job stops at once; a live one goes stopping and every node of it gets a
    JobStopOrder (asked again while stopping, the orders are sent again). Else Conflict."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        state = JobState(job.state)
        if state is JobState.STARTING and start_cancel(job, "", failed=False):  # no rank was ordered to start
            job.state = job_next_state(JobState.PENDING, JobTrigger.STOP)
            job.save(update_fields=["state", "updated_at"])
            publish_job(job, "upsert")
            return job
        if state is JobState.RESTORING:  # no world trains; the restore task finds it stopped
            nodes = transitions.job_nodes(job) + [g.node.name for g in job.gpus.select_related("node")]
            job_finish(job, state=job_next_state(state, JobTrigger.STOP))
            stop_on_commit(job, list(dict.fromkeys(nodes)))
            return job
        if state is not JobState.STOPPING:
            if state not in STOPPABLE_JOB_STATES:
                raise Conflict(f"job {job.name!r} is {job.state}; only a pending or live job can be stopped")
            job.state = job_next_state(state, JobTrigger.STOP)
            job.save(update_fields=["state", "updated_at"])
            publish_job(job, "upsert")
        stop_on_commit(job, transitions.job_nodes(job) if job.state == JobState.STOPPING else [])
    return job
