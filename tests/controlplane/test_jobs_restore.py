"""Periodic checkpoints and restore after lost ranks, control-plane half (issue 6):
checkpoint reports keep the latest on the job; a node lost (or a rank failure) with a
checkpoint sends the job `restoring` and then restarts it from the checkpoint on the GPUs
it has left, with a `restore` row that says what happened; without one the job fails
saying so.

Real PostgreSQL (or SQLite) and Redis; only the control plane's Celery send_task is
replaced, by a recorder, since no agent runs here.
"""
from __future__ import annotations

import os
from datetime import datetime, timedelta, timezone

import pytest
from django.conf import settings
from django.utils import timezone as dj_timezone

from agents import protocol
from tests.support.reports import report_of
from controlplane.cluster import services as cluster
from controlplane.cluster.models import Gpu
from controlplane.jobs import node_loss, restore
from controlplane.jobs.events import CheckpointEvent, apply_job_event, job_event_adapter
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.reports import job_record_report
from controlplane.jobs.selectors import job_live_snapshot
from controlplane.jobs.tasks import job_report, transition_report
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db


def make_report(job: Job, kind: str, node: str = "node-1", **fields) -> protocol.JobReport:
    return report_of(job.pk, kind, node, **fields)


def started_job(run, token_client, name="j", **body) -> Job:
    body = {"name": name, "model": "tiny-gpt", "global_batch": 12, **body}
    response = run(token_client.post, "/api/jobs", body, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    run(job_record_report, report=make_report(job, "started"))
    return job


def trained_to(run, job: Job, step: int, checkpoint: int | None) -> None:
    if checkpoint is not None:
        run(job_record_report, report=make_report(job, "checkpoint", step=checkpoint,
                                              checkpoint_path=f"/ckpt/step-{checkpoint:08d}", seconds=0.4))
    run(job_record_report, report=make_report(job, "step", step=step, loss=3.0))


def gpu_states() -> dict[str, tuple[str, str | None]]:
    return {f"{g.node.name}/{g.index}": (g.state, g.job.name if g.job else None)
            for g in Gpu.objects.select_related("node", "job")}


def lose_node(run, node: str, keep: str) -> list[str]:
    later = dj_timezone.now() + timedelta(seconds=10)
    cluster.node_record_heartbeat(report=heartbeat(keep, gpus=2, host=f"host-{keep[-1]}"), received_at=later)
    return run(node_loss.nodes_lost_sweep, silent_for=timedelta(seconds=6), now=later)


def sent_of(sent, name) -> list[tuple[dict, str]]:
    return [(message, queue) for task, message, queue in sent if task == name]


# --- checkpoints ------------------------------------------------------------------------------

def test_checkpoint_settings_reach_the_orders_and_reports_keep_the_latest(two_nodes, token_client, sent_tasks,
                                                                         sent_events, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=5)
    assert job.checkpoint_dir == str(settings.VAR_DIR / "checkpoints" / f"j-{job.pk}")
    orders = [protocol.JobStartOrder.model_validate(m) for m, _ in sent_of(sent_tasks, protocol.NODE_JOB_START)]
    assert {(o.checkpoint_interval, o.checkpoint_dir, o.restore_from, o.restore_id) for o in orders} == {
        (5, job.checkpoint_dir, "", None)}
    trained_to(run, job, 12, 10)
    run(job_record_report, report=make_report(job, "checkpoint", step=5, checkpoint_path="/ckpt/step-00000005"))  # late
    job.refresh_from_db()
    assert (job.checkpoint_step, job.checkpoint_path, job.checkpoint_seconds, job.step) == (
        10, "/ckpt/step-00000010", 0.4, 12)
    events = [e for e in sent_events if isinstance(e, CheckpointEvent)]
    assert [(e.step, e.path) for e in events] == [(10, "/ckpt/step-00000010")]
    event = job_event_adapter.validate_python(events[0].model_dump())
    snapshot = job_live_snapshot(job_id=job.pk)
    assert apply_job_event(snapshot.model_copy(update={"seq": event.seq - 1}), event).seq == event.seq
    body = token_client.get(f"/api/jobs/{job.pk}").json()
    assert (body["checkpoint_interval"], body["checkpoint_step"], body["step"]) == (5, 10, 12)


def test_checkpoint_fields_are_checked(two_nodes, token_client, run) -> None:
    bad = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", "gpus": 1,
                                               "checkpoint_dir": "/shared/ckpt"}, format="json")
    assert bad.status_code == 400 and "outside the checkpoint root" in bad.json()["checkpoint_dir"][0]
    bad = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", "gpus": 1,
                                               "checkpoint_interval": -1}, format="json")
    assert bad.status_code == 400 and "checkpoint_interval" in bad.json()
    root = os.path.realpath(settings.DYNAPLANE_CHECKPOINT_ROOT)
    off = started_job(run, token_client, "off", gpus=1, checkpoint_interval=0, checkpoint_dir="shared/ckpt")
    assert (off.checkpoint_interval, off.checkpoint_dir) == (0, os.path.join(root, "shared", "ckpt"))
    inside = started_job(run, token_client, "inside", gpus=1, checkpoint_dir=os.path.join(root, "abs"))
    assert inside.checkpoint_dir == os.path.join(root, "abs")


# --- node loss --------------------------------------------------------------------------------

def test_a_node_lost_while_training_restores_the_job_on_the_survivors(two_nodes, token_client, sent_tasks,
                                                                     run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=10)
    old_port = job.rendezvous_port
    trained_to(run, job, 14, 10)
    sent_tasks.clear()
    assert lose_node(run, "node-2", keep="node-1") == ["node-2"]
    job.refresh_from_db()
    assert job.state == "restoring" and job.error.endswith(
        "node node-2 (ranks 2, 3) lost; restoring from checkpoint step 10 unless the surviving ranks take over")
    # node-1's ranks may have outlived their world (a silent node: they learn it at their step
    # timeout): a first look, and the final one once they would have reported.
    assert sent_of(sent_tasks, protocol.CONTROL_JOB_RESTORE) == [(job.pk, protocol.CONTROL_FLOWS_QUEUE)] * 2
    sent_tasks.clear()
    row = run(restore.job_restore, job_id=job.pk)
    job.refresh_from_db()
    assert (job.state, job.layout, job.world_size, job.error) == ("starting", "dp=2", 2, "")
    assert job.placement == [{"rank": 0, "node": "node-1", "gpu": 0}, {"rank": 1, "node": "node-1", "gpu": 1}]
    assert job.rendezvous_port != old_port and job.rendezvous == f"host-1:{job.rendezvous_port}"
    assert (row.kind, row.state, row.source_layout, row.destination_layout, row.step) == (
        "restore", "planned", "dp=4", "dp=2", 10)
    assert row.reason == ("node node-2 (ranks 2, 3) lost at step 14; restored from checkpoint step 10 "
                          "(4 steps redone) on 2 GPUs as dp=2; the surviving ranks (2 of 4) still held a full "
                          "replica of the state; not switched on them: no surviving rank outlived its world (none "
                          "reported waiting for a recovery order)")
    ((message, queue),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    order = protocol.JobStartOrder.model_validate(message)
    assert (queue, order.restore_from, order.restore_id, order.layout, order.world) == (
        "node.node-1", "/ckpt/step-00000010", row.pk, "dp=2", 2)
    gpus = gpu_states()
    assert (gpus["node-1/0"], gpus["node-2/0"]) == (("allocated", "j"), ("lost", None))
    # A report of the old world is ignored; the new world's `restored` commits the row.
    run(job_report, make_report(job, "failed", ranks=(0,), error="gloo: connection closed").model_dump(mode="json"))
    assert Job.objects.get(pk=job.pk).state == "starting"
    run(job_record_report, report=make_report(job, "restored", step=10, verified=True, seconds=1.5, restore_id=row.pk))
    run(job_record_report, report=make_report(job, "started", step=11, restore_id=row.pk))
    row.refresh_from_db()
    job.refresh_from_db()
    assert (row.state, row.verification["verified"], row.transfer_seconds) == ("committed", True, 1.5)
    assert [h["state"] for h in row.history] == ["planned", "committed"]
    assert job.state == "running"
    listed = token_client.get(f"/api/transitions?job={job.pk}").json()["results"]
    assert [(t["kind"], t["state"]) for t in listed] == [("restore", "committed")]


def test_a_rank_failure_waits_for_the_node_loss_then_restores_and_does_not_loop(two_nodes, token_client,
                                                                                sent_tasks, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=10)
    trained_to(run, job, 12, 10)
    sent_tasks.clear()
    run(job_report, make_report(job, "failed", ranks=(1,), error="gloo: connection reset").model_dump(mode="json"))
    job.refresh_from_db()
    assert job.state == "restoring" and "node node-1 ranks 1 failed" in job.error
    # Queued with a delay: a dead node is marked lost by then, so the restore leaves it out.
    assert protocol.CONTROL_JOB_RESTORE in [name for name, _, _ in sent_tasks]
    run(job_report, make_report(job, "failed", node="node-2", ranks=(2,)).model_dump(mode="json"))  # already restoring
    row = run(restore.job_restore, job_id=job.pk)
    job.refresh_from_db()
    assert (job.state, job.layout, len(job.placement)) == ("starting", "dp=4", 4)  # every node still healthy
    assert row.reason.startswith("node node-1 ranks 1 failed at step 12; restored from checkpoint step 10")
    # The restarted world fails as well, before a newer checkpoint: the job fails, no second restore.
    run(job_report, make_report(job, "failed", ranks=(0,), error="boom", restore_id=row.pk).model_dump(mode="json"))
    job.refresh_from_db()
    row.refresh_from_db()
    assert job.state == "failed" and job.error == "node node-1 ranks 0: boom"
    assert row.state == "aborted"
    assert restore.no_restore_reason(job).startswith("the restore from checkpoint step 10 failed too")


def test_a_node_lost_without_a_checkpoint_fails_the_job_saying_so(two_nodes, token_client, sent_tasks, run) -> None:
    none_yet = started_job(run, token_client, gpus=2)  # node-1
    off = started_job(run, token_client, "off", gpus=2, checkpoint_interval=0)  # node-2
    trained_to(run, none_yet, 3, None)
    later = dj_timezone.now() + timedelta(seconds=10)
    assert run(node_loss.nodes_lost_sweep, silent_for=timedelta(seconds=6), now=later) == ["node-1", "node-2"]
    none_yet.refresh_from_db()
    off.refresh_from_db()
    assert none_yet.state == "failed" and none_yet.error.endswith("; no checkpoint to restore from")
    assert off.state == "failed" and off.error.endswith("(checkpoint_interval=0: checkpoints are off)")


def test_old_ranks_lost_during_a_transfer_restore_from_the_checkpoint_on_the_joining_gpus(
        two_nodes, token_client, sent_tasks, run) -> None:
    job = started_job(run, token_client, layout="dp=2", checkpoint_interval=10)  # node-1
    trained_to(run, job, 20, 20)
    response = run(token_client.post, f"/api/jobs/{job.pk}/resize", {"gpus": 4}, format="json")
    resize = Transition.objects.get(pk=response.json()["id"])
    run(transition_report, protocol.TransitionReport(job_id=job.pk, transition_id=resize.pk, node="node-1",
                                                     state="transferring", sent_at=datetime.now(timezone.utc),
                                                     step=21).model_dump(mode="json"))
    lose_node(run, "node-1", keep="node-2")
    resize.refresh_from_db()
    job.refresh_from_db()
    assert resize.state == "aborted"
    assert "ranks lost while the resize was transferring: node node-1 (ranks 0, 1) lost; restoring from " \
           "checkpoint step 20" in resize.reason
    assert job.state == "restoring"
    row = run(restore.job_restore, job_id=job.pk)
    job.refresh_from_db()
    assert (job.layout, job.placement) == ("dp=2", [{"rank": 0, "node": "node-2", "gpu": 0},
                                                    {"rank": 1, "node": "node-2", "gpu": 1}])
    assert row.source_layout == "dp=2" and "restored from checkpoint step 20" in row.reason
    assert row.reason.endswith("; the surviving ranks (0 of 2) no longer held every state element "
                               "(78 tensor states incomplete, e.g. llm.embed.weight param)")
    assert gpu_states()["node-1/0"] == ("lost", None)


def test_stop_while_restoring_stops_at_once_and_the_restore_task_then_does_nothing(two_nodes, token_client,
                                                                                    sent_tasks, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=10)
    trained_to(run, job, 12, 10)
    run(job_report, make_report(job, "failed", ranks=(1,)).model_dump(mode="json"))
    response = run(token_client.post, f"/api/jobs/{job.pk}/stop", {}, format="json")
    assert response.status_code == 200 and response.json()["state"] == "stopped"
    assert run(restore.job_restore, job_id=job.pk) is None
    assert {state for state, _ in gpu_states().values()} == {"free"}


def test_the_restore_task_is_registered_with_the_control_worker() -> None:
    from controlplane.celery import app

    app.loader.import_default_modules()
    assert protocol.CONTROL_JOB_RESTORE in app.tasks


def test_a_restore_rewinds_the_record_to_its_checkpoint_and_the_retrained_steps_replace_the_lost_ones(
        two_nodes, token_client, sent_tasks, sent_events, run) -> None:
    """Issue 43 item 2: steps 11-14 were trained after the checkpoint at step 10 and lost with a
    node; the restored world trains them again. The series then holds each step once, the
    retrained values, and the page's snapshot, kept up by the events, says the same."""
    from controlplane.jobs.events import JobLiveSnapshot, RewindEvent

    job = started_job(run, token_client, gpus=4, checkpoint_interval=10)
    snapshot = job_live_snapshot(job_id=job.pk)
    for step in range(1, 15):
        trained_to(run, job, step, 10 if step == 10 else None)
    assert lose_node(run, "node-2", keep="node-1") == ["node-2"]
    row = run(restore.job_restore, job_id=job.pk)
    run(job_record_report, report=make_report(job, "restored", step=10, verified=True, seconds=1.5, restore_id=row.pk))
    job.refresh_from_db()
    assert job.step == 10
    assert job_live_snapshot(job_id=job.pk).metrics["loss"].x == tuple(float(s) for s in range(1, 11))
    for step in range(11, 13):
        run(job_record_report, report=make_report(job, "step", step=step, loss=1.0 / step, restore_id=row.pk))
    live = job_live_snapshot(job_id=job.pk)
    assert live.metrics["loss"].x == tuple(float(s) for s in range(1, 13))
    assert live.metrics["loss"].y[10:] == (1.0 / 11, 1.0 / 12)  # the retrained values
    rewinds = [e for e in sent_events if isinstance(e, RewindEvent)]
    assert [(e.job, e.step) for e in rewinds] == [(job.pk, 10)]
    for event in sent_events:  # the page's snapshot, kept up by the job's events, agrees
        if getattr(event, "job", None) == job.pk or getattr(getattr(event, "transition", None), "job", None) == job.pk:
            snapshot = apply_job_event(snapshot, event)
    assert snapshot.metrics["loss"] == live.metrics["loss"]
    assert isinstance(snapshot, JobLiveSnapshot)
