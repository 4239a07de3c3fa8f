"""snapshot(before) + events == snapshot(after), for random sequences of writes."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents import protocol
from controlplane.cluster import services
from controlplane.cluster.events import apply_event, cluster_event_adapter
from controlplane.cluster.models import Node
from controlplane.cluster.selectors import cluster_snapshot
from controlplane.common.models import EventStream
from controlplane.jobs.models import Job
from controlplane.common.errors import InvalidInput
from controlplane.jobs.elastic_settings import job_elastic_set
from controlplane.jobs.services import job_create, job_delete
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db

nodes = st.sampled_from(["node-1", "node-2", "node-3"])
operations = st.lists(
    st.one_of(
        st.tuples(st.just("beat"), nodes, st.integers(1, 4)),
        # a beat with host stats: CPU % and memory used (GiB of 16), some of them changes worth an event
        st.tuples(st.just("beat-stats"), nodes, st.tuples(st.floats(0, 100), st.integers(0, 16))),
        st.tuples(st.just("silence"), nodes, st.just(0)),
        st.tuples(st.just("sweep"), st.just(""), st.just(0)),
        st.tuples(st.just("create"), st.sampled_from(["a", "b"]), st.integers(1, 4)),
        st.tuples(st.just("delete"), st.sampled_from(["a", "b"]), st.just(0)),
        # elastic settings (PATCH /api/jobs/{id}/elastic): the jobs list shows them live
        st.tuples(st.just("elastic"), st.sampled_from(["a", "b"]),
                  st.tuples(st.booleans(), st.sampled_from([None, 1, 2, 4]), st.sampled_from([None, 2, 4, 8]),
                            st.integers(-3, 3))),
        st.tuples(st.just("queue"), st.sampled_from(["a", "b"]), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=12,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before_ops=operations, ops=operations)
def test_snapshot_plus_events_is_later_snapshot(before_ops, ops, django_capture_on_commit_callbacks, sent_events):
    for model in (Job, Node, EventStream):
        model.objects.all().delete()
    clock = {"now": timezone.now()}

    def run(op) -> None:
        kind, name, n = op
        clock["now"] += timedelta(seconds=1)
        if kind == "beat":
            services.node_record_heartbeat(report=heartbeat(name, gpus=n), received_at=clock["now"])
        elif kind == "beat-stats":
            stats = protocol.HostStats(cpu_percent=n[0], cpu_count=8, memory_used_bytes=n[1] * 2**30,
                                       memory_total_bytes=16 * 2**30)
            services.node_record_heartbeat(report=heartbeat(name, host_stats=stats), received_at=clock["now"])
        elif kind == "silence":
            Node.objects.filter(name=name).update(last_heartbeat=clock["now"] - timedelta(seconds=60))
        elif kind == "sweep":
            services.nodes_mark_lost(silent_for=timedelta(seconds=30), now=clock["now"])
        elif kind == "create" and not Job.objects.filter(name=name).exists():
            try:
                job_create(name=name, model="tiny-gpt", layout=f"dp={n}")
            except InvalidInput:  # more GPUs than the inventory, or a batch dp does not split: nothing published
                pass
        elif kind == "queue" and not Job.objects.filter(name=name).exists():
            try:
                job_create(name=name, model="tiny-gpt", layout=f"dp={n}", queued=True, priority=n)
            except InvalidInput:
                pass
        elif kind == "elastic" and Job.objects.filter(name=name).exists():
            elastic, lo, hi, priority = n
            try:
                job_elastic_set(job_id=Job.objects.get(name=name).pk, elastic=elastic, min_gpus=lo, max_gpus=hi,
                                priority=priority)
            except InvalidInput:  # a range that does not hold the job's size: nothing written, nothing published
                pass
        elif kind == "delete" and Job.objects.filter(name=name).exists():
            job_delete(job_id=Job.objects.get(name=name).pk)

    with django_capture_on_commit_callbacks(execute=True):
        for op in before_ops:
            run(op)
    before = cluster_snapshot()
    sent_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        for op in ops:
            run(op)
    after = cluster_snapshot()

    replayed = before
    for event in sent_events:
        wire = cluster_event_adapter.validate_python(event.model_dump(mode="json"))  # closed schema, as sent
        replayed = apply_event(replayed, wire)
    assert replayed.seq == after.seq
    assert replayed.canonical() == after.canonical()
    for job in after.jobs:  # the elastic settings travel with the job's events
        row = Job.objects.get(pk=job.id)
        assert (job.elastic, job.min_gpus, job.max_gpus, job.priority, job.queued) == (
            row.elastic, row.min_gpus, row.max_gpus, row.priority, row.queued)
    # Replaying an event twice changes nothing (a snapshot read racing an event is safe).
    for event in sent_events:
        assert apply_event(replayed, event) == replayed
