"""Changing a job's elastic settings: the policy switch, its GPU range and its priority
(PATCH /api/jobs/{id}/elastic). The elastic scheduler reads them; nothing else moves here."""
from __future__ import annotations

from django.db import transaction

from controlplane.cluster.selectors import inventory_capacity
from controlplane.common.errors import InvalidInput
from controlplane.jobs.elastic_range import range_problems
from controlplane.jobs.models import Job
from controlplane.jobs.services import publish_job

FIELDS = ("elastic", "min_gpus", "max_gpus", "priority")


def job_elastic_set(*, job_id: int, **changes) -> Job:
    """Set any of FIELDS (a range bound given as None means the job's world_size); the range
    must still hold the GPUs the job runs on (world_size, read under the job's lock) and fit
    the cluster, else InvalidInput (400) names the field and the rule, and nothing is written."""
    unknown = sorted(set(changes) - set(FIELDS))
    if unknown:
        raise InvalidInput({unknown[0]: [f"not an elastic setting; these are {', '.join(FIELDS)}"]})
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        for name, value in changes.items():
            setattr(job, name, value)
        problems = range_problems(min_gpus=job.min_gpus, max_gpus=job.max_gpus, world_size=job.world_size,
                                  cluster_gpus=inventory_capacity()[0])
        if problems:
            raise InvalidInput(problems)
        job.save(update_fields=[*changes, "updated_at"])
        publish_job(job, "upsert")
    return job
