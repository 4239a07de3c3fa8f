"""Emulation runs: snapshot(before) + events == snapshot(after) for the runs a compare page
follows, for random sequences of creations and agent progress reports."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agents import protocol
from controlplane.common.models import EventStream
from controlplane.emulation import services
from controlplane.emulation.events import EmulationSnapshot, apply_emulation_event, emulation_event_adapter
from controlplane.emulation.models import EmulationRun
from controlplane.emulation.selectors import emulation_snapshot

pytestmark = pytest.mark.django_db

CONFIG = {"model": "tiny-gpt", "layout": "tp=2,dp=2", "gpus": 4, "gpu_type": "h100", "global_batch": 8,
          "micro_batch": 1, "seq_len": 32, "recompute": "none"}
operations = st.lists(
    st.one_of(
        st.tuples(st.just("create"), st.integers(1, 2)),
        st.tuples(st.sampled_from(["running", "done", "failed"]), st.integers(0, 5)),
    ),
    min_size=1, max_size=10,
)


@pytest.fixture(autouse=True)
def no_dispatch(monkeypatch):
    """The runs' orders are not the subject here: keep them off the broker."""
    monkeypatch.setattr(services, "_dispatch", lambda order: None)


def _run(op) -> None:
    kind, n = op
    if kind == "create":
        services.emulation_create(configs=[dict(CONFIG, layout=layout) for layout in ["tp=2,dp=2", "dp=4"][:n]])
        return
    ids = list(EmulationRun.objects.order_by("pk").values_list("pk", flat=True))
    if not ids:
        return
    result = {"step_seconds": 0.1 * (n + 1)} if kind == "done" else None
    services.emulation_record_progress(progress=protocol.EmulationProgress(
        run_id=ids[n % len(ids)], state=kind, message=f"step {n}", result=result,
        error="boom" if kind == "failed" else "", wall_seconds=1.0 if kind in ("done", "failed") else None))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(before_ops=operations, ops=operations, follow=st.lists(st.integers(0, 12), max_size=4, unique=True))
def test_snapshot_plus_events_is_later_snapshot(before_ops, ops, follow, django_capture_on_commit_callbacks,
                                                sent_events):
    for model in (EmulationRun, EventStream):
        model.objects.all().delete()
    with django_capture_on_commit_callbacks(execute=True):
        for op in before_ops:
            _run(op)
    first = EmulationRun.objects.order_by("pk").values_list("pk", flat=True).first() or 1
    ids = [first + i for i in follow]  # some may not exist yet, or ever
    before = emulation_snapshot(ids)
    sent_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        for op in ops:
            _run(op)
    after = emulation_snapshot(ids)

    replayed = before
    for event in sent_events:
        wire = emulation_event_adapter.validate_python(event.model_dump(mode="json"))  # closed schema, as sent
        replayed = apply_emulation_event(replayed, wire)
    assert replayed.seq == after.seq
    assert replayed == after
    for event in sent_events:  # replaying an event twice changes nothing
        assert apply_emulation_event(replayed, event) == replayed


def test_snapshot_keeps_the_pages_order_and_leaves_out_unknown_runs(django_capture_on_commit_callbacks) -> None:
    with django_capture_on_commit_callbacks(execute=True):
        a, b = services.emulation_create(configs=[CONFIG, dict(CONFIG, layout="dp=4")])
    snapshot = emulation_snapshot([b.pk, 999_999, a.pk, b.pk])
    assert snapshot.ids == (b.pk, 999_999, a.pk)
    assert [r.layout for r in snapshot.runs] == ["dp=4", "tp=2,dp=2"]
    assert isinstance(snapshot, EmulationSnapshot) and snapshot.runs[0].global_batch == 8
