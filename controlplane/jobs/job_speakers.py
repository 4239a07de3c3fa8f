"""Which nodes may speak of a job (issue 44): an agent's report about a job is heard only from a
node that holds or held the job's ranks (its placement, or either side of one of its switches).
Sealed messages name their node (cluster/agent_auth.py); this binds that node to the job."""
from __future__ import annotations

import threading
import time

from controlplane.cluster.agent_auth import heard_from, refused
from controlplane.jobs.models import Job, Transition

# A node found serving a job is not looked up again for this long. Holding or having held a job's
# ranks is for good (the bound only matters for a deleted job whose id SQLite gives again): at
# 5 s, 200 jobs' rank zeros cost a worker 40 lookups a second (benchmarks/cluster_scale.py).
SERVES_CACHE_SECONDS = 60.0


def _nodes(placement: object) -> set[str]:
    return {slot.get("node") for slot in placement if isinstance(slot, dict)} if isinstance(placement, list) else set()


def node_serves(job_id: object, node: str) -> bool:
    """Whether `node` holds, or held, ranks of job `job_id`."""
    if not isinstance(job_id, int) or isinstance(job_id, bool) or job_id <= 0:
        return False
    placement = Job.objects.filter(pk=job_id).values_list("placement", flat=True).first()
    if placement is None:
        return False
    if node in _nodes(placement):
        return True
    for source, destination in Transition.objects.filter(job_id=job_id).values_list(
            "source_placement", "destination_placement"):
        if node in _nodes(source) or node in _nodes(destination):
            return True
    return False


class _Served:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, str], float] = {}

    def __call__(self, job_id: object, node: str) -> bool:
        now = time.monotonic()
        with self._lock:
            seen = self._seen.get((job_id, node))
        if seen is not None and now - seen < SERVES_CACHE_SECONDS:
            return True
        if not node_serves(job_id, node):
            return False
        with self._lock:
            if len(self._seen) > 100_000:
                self._seen.clear()
            self._seen[(job_id, node)] = now
        return True

    def forget(self) -> None:
        with self._lock:
            self._seen.clear()


SERVED = _Served()


def job_message_heard(task: str, body: dict, received: object) -> bool:
    """Whether `body` (a message about body["job_id"]) is sealed by a node serving that job, or
    by the control plane; a refusal is logged."""
    who = heard_from(task, body, received)
    if who is None:
        return False
    if who.is_control_plane or SERVED(body.get("job_id"), who.node):
        return True
    refused(task, received, f"node {who.node} holds no ranks of job {body.get('job_id')!r}")
    return False
