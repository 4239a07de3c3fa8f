"""The cluster page's snapshot at thousands of GPUs: the same content and seq rule as
selectors.cluster_snapshot, read as plain rows (no model object or view per GPU: 8,192 of
each took most of the page's server time) and handed to the page's compact encoder."""
from __future__ import annotations

from django.apps import apps
from django.db import transaction

from controlplane.cluster.events import STREAM
from controlplane.cluster.models import Gpu, Node
from controlplane.cluster.selectors import job_view, node_view
from controlplane.common.events import current_seq


def cluster_rows() -> tuple[int, list[dict], list[tuple], list[dict]]:
    """(seq, node views as dicts, GPU rows (node, index, model_name, memory_bytes, state, job
    name or None), job views as dicts). The seq is read first, as in cluster_snapshot."""
    Job = apps.get_model("jobs", "Job")  # by name: the jobs app builds on this one
    with transaction.atomic():
        seq = current_seq(STREAM)
        nodes = [node_view(n).model_dump(mode="json") for n in Node.objects.all()]
        gpus = list(Gpu.objects.order_by("node__name", "index")
                    .values_list("node__name", "index", "model_name", "memory_bytes", "state", "job__name"))
        jobs = [job_view(j).model_dump(mode="json") for j in Job.objects.order_by("id")]
    return seq, nodes, gpus, jobs
