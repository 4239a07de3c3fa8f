"""Jobs on the node agents: allocation, start/stop orders, reports, node loss (issue 6).

Real PostgreSQL (or SQLite) and Redis; only the control plane's Celery send_task is
replaced, by a recorder, since no agent runs here.
"""
from __future__ import annotations

import logging
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone as dj_timezone

from agents import protocol
from tests.support.reports import report_of
from controlplane.cluster import services as cluster
from controlplane.cluster.models import Gpu
from controlplane.common.errors import Conflict
from controlplane.jobs import node_loss, restore, scheduling
from controlplane.jobs.events import JobLiveSnapshot, MetricsEvent, apply_job_event, job_event_adapter
from controlplane.jobs.models import Job
from controlplane.jobs.reports import job_record_report
from controlplane.jobs.selectors import job_live_snapshot, metric_points
from controlplane.jobs.tasks import job_report
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db


def _orders(sent, task=protocol.NODE_JOB_START) -> dict[str, dict]:
    return {queue: message for name, message, queue in sent if name == task}


def _report(job_id: int, kind: str, node: str = "node-1", **fields) -> protocol.JobReport:
    return report_of(job_id, kind, node, **fields)


def _gpus() -> dict[str, tuple[str, str | None]]:
    return {f"{g.node.name}/{g.index}": (g.state, g.job.name if g.job else None)
            for g in Gpu.objects.select_related("node", "job")}


def _started_job(run, token_client, name="j", **body) -> Job:
    response = run(token_client.post, "/api/jobs", {"name": name, "model": "tiny-gpt", **body}, format="json")
    assert response.status_code == 201, response.content
    return Job.objects.get(pk=response.json()["id"])


# --- allocation and start orders --------------------------------------------------------

def test_gpus_picks_data_parallelism_across_two_nodes(two_nodes, token_client, sent_tasks, run) -> None:
    response = run(token_client.post, "/api/jobs",
                   {"name": "j", "model": "tiny-gpt", "gpus": 4, "max_steps": 50}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["layout"], body["world_size"], body["state"], body["max_steps"]) == ("dp=4", 4, "starting", 50)
    assert body["placement"] == [{"rank": 0, "node": "node-1", "gpu": 0}, {"rank": 1, "node": "node-1", "gpu": 1},
                                 {"rank": 2, "node": "node-2", "gpu": 0}, {"rank": 3, "node": "node-2", "gpu": 1}]
    assert body["rendezvous"] == "host-1:29400"
    assert set(_gpus().values()) == {("allocated", "j")}

    orders = _orders(sent_tasks)
    assert set(orders) == {"node.node-1", "node.node-2"}
    one, two = (protocol.JobStartOrder.model_validate(orders[q]) for q in ("node.node-1", "node.node-2"))
    assert [(s.rank, s.gpu) for s in one.ranks] == [(0, 0), (1, 1)]
    assert [(s.rank, s.gpu) for s in two.ranks] == [(2, 0), (3, 1)]
    for order in (one, two):
        assert (order.job_id, order.job_name, order.model, order.layout, order.world) == (body["id"], "j", "tiny-gpt",
                                                                                          "dp=4", 4)
        assert (order.rendezvous, order.max_steps, order.global_batch, order.seq) == ("host-1:29400", 50, 8, 128)


def test_tensor_parallel_groups_stay_inside_a_node(two_nodes, token_client, sent_tasks, run) -> None:
    _started_job(run, token_client, "small", layout="dp=1")  # node-1 keeps one free GPU
    job = _started_job(run, token_client, "tp", layout="tp=2")
    assert job.placement == [{"rank": 0, "node": "node-2", "gpu": 0}, {"rank": 1, "node": "node-2", "gpu": 1}]
    assert job.rendezvous == "host-2:29401"  # rank 0's host; the next free port
    response = run(token_client.post, "/api/jobs", {"name": "tp2", "model": "tiny-gpt", "layout": "tp=2"},
                   format="json")
    assert response.status_code == 409  # one GPU free, but a TP group needs two on one node
    assert "groups of tp=2" in response.json()["detail"]


def test_not_enough_gpus_is_a_conflict_and_leaves_nothing_behind(two_nodes, token_client, sent_tasks, run) -> None:
    response = run(token_client.post, "/api/jobs", {"name": "big", "model": "tiny-gpt", "gpus": 8}, format="json")
    assert response.status_code == 400  # more than the cluster has: no state of it could ever hold the job
    assert response.json()["gpus"] == ["the layout dp=8 spans 8 GPUs; the cluster has 4"]
    small = run(token_client.post, "/api/jobs", {"name": "small", "model": "tiny-gpt", "gpus": 2}, format="json")
    assert small.status_code == 201
    sent_tasks.clear()
    response = run(token_client.post, "/api/jobs", {"name": "big", "model": "tiny-gpt", "gpus": 4}, format="json")
    assert response.status_code == 409  # the cluster could hold it, its free GPUs cannot now
    assert "cannot be placed" in response.json()["detail"] and "2 free in all" in response.json()["detail"]
    assert list(Job.objects.values_list("name", flat=True)) == ["small"] and not sent_tasks
    assert sorted(state for state, _ in _gpus().values()) == ["allocated"] * 2 + ["free"] * 2


def test_lost_nodes_gpus_are_not_allocated(two_nodes, token_client, sent_tasks, run) -> None:
    Gpu.objects.filter(node__name="node-2").update(state="lost")
    response = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", "gpus": 4}, format="json")
    assert response.status_code == 409 and "2 free in all" in response.json()["detail"]


@pytest.mark.parametrize(("body", "field", "fragment"), [
    ({"layout": "tp=3"}, "layout", "tp=3 does not divide 4 attention heads"),
    ({"layout": "dp=2", "model": "no-such-model"}, "model", "unknown model 'no-such-model'"),
    ({"layout": "dp=2", "gpus": 2}, "layout", "either `layout` or `gpus`"),
    ({}, "layout", "either `layout` or `gpus`"),
    ({"gpus": 3}, "global_batch", "global_batch=8 is not a multiple of micro_batch=1 x dp=3"),
    ({"gpus": 0}, "gpus", "greater than or equal to 1"),
    ({"layout": "dp=2", "max_steps": 0}, "max_steps", "greater than or equal to 1"),
])
def test_bad_requests_are_400_naming_the_rule(two_nodes, token_client, sent_tasks, run, body, field,
                                              fragment) -> None:
    response = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", **body}, format="json")
    assert response.status_code == 400, response.content
    errors = response.json()
    assert any(fragment in message for message in errors.get(field, [])), errors
    assert not Job.objects.exists() and not sent_tasks


def test_start_false_keeps_the_job_pending_until_started(two_nodes, token_client, sent_tasks, run) -> None:
    job = _started_job(run, token_client, layout="dp=2", start=False)
    assert (job.state, job.placement, job.rendezvous) == ("pending", [], "")
    assert not sent_tasks and {state for state, _ in _gpus().values()} == {"free"}
    response = run(token_client.post, f"/api/jobs/{job.pk}/start")
    assert response.status_code == 200 and response.json()["state"] == "starting"
    assert set(_orders(sent_tasks)) == {"node.node-1"}
    assert run(token_client.post, f"/api/jobs/{job.pk}/start").status_code == 409


def test_rendezvous_ports_are_reused_after_a_job_ends(two_nodes, token_client, sent_tasks, run, settings) -> None:
    settings.DYNAPLANE_RENDEZVOUS_PORTS = "29500-29501"
    first = _started_job(run, token_client, "a", layout="dp=1")
    second = _started_job(run, token_client, "b", layout="dp=1")
    assert (first.rendezvous, second.rendezvous) == ("host-1:29500", "host-2:29501")  # most free GPUs first
    response = run(token_client.post, "/api/jobs", {"name": "c", "model": "tiny-gpt", "layout": "dp=1"},
                   format="json")
    assert response.status_code == 409 and "rendezvous ports 29500-29501" in response.json()["detail"]
    run(job_record_report, report=_report(first.pk, "failed", ranks=(0,), error="boom"))
    assert _started_job(run, token_client, "d", layout="dp=1").rendezvous.endswith(":29500")


@pytest.mark.django_db(transaction=True)
def test_concurrent_starts_never_double_book_a_gpu(two_nodes, sent_tasks) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks are a PostgreSQL matter (SQLite serializes all writers)")
    jobs = [scheduling.job_submit(name=f"c{i}", model="tiny-gpt", layout="dp=2", start=False) for i in range(5)]
    barrier = threading.Barrier(len(jobs))
    outcome: dict[int, str] = {}

    def start(job_id: int) -> None:
        try:
            barrier.wait(timeout=10)
            scheduling.job_start(job_id=job_id)
            outcome[job_id] = "started"
        except Conflict:
            outcome[job_id] = "conflict"
        finally:
            connection.close()

    threads = [threading.Thread(target=start, args=(job.pk,)) for job in jobs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert sorted(outcome.values()) == ["conflict"] * 3 + ["started"] * 2
    started = Job.objects.filter(state="starting")
    slots = [(s["node"], s["gpu"]) for job in started for s in job.placement]
    assert len(slots) == len(set(slots)) == 4
    assert len({job.rendezvous_port for job in started}) == 2
    for job in started:
        assert sorted((g.node.name, g.index) for g in job.gpus.all()) == sorted((s["node"], s["gpu"])
                                                                                 for s in job.placement)
    assert sorted(queue for _, _, queue in sent_tasks) == ["node.node-1", "node.node-2"]  # a node each


# --- stop ---------------------------------------------------------------------------------

def test_stop_orders_and_stop_states(two_nodes, token_client, sent_tasks, run) -> None:
    job = _started_job(run, token_client, gpus=4)
    response = run(token_client.post, f"/api/jobs/{job.pk}/stop")
    assert response.status_code == 200 and response.json()["state"] == "stopping"
    stops = _orders(sent_tasks, protocol.NODE_JOB_STOP)
    assert set(stops) == {"node.node-1", "node.node-2"}
    assert protocol.JobStopOrder.model_validate(stops["node.node-1"]).job_id == job.pk
    sent_tasks.clear()
    assert run(token_client.post, f"/api/jobs/{job.pk}/stop").status_code == 200  # again: orders sent again
    assert len(_orders(sent_tasks, protocol.NODE_JOB_STOP)) == 2

    run(job_record_report, report=_report(job.pk, "stopped"))
    job.refresh_from_db()
    assert job.state == "stopped" and {state for state, _ in _gpus().values()} == {"free"}
    response = run(token_client.post, f"/api/jobs/{job.pk}/stop")
    assert response.status_code == 409 and "only a pending or live job" in response.json()["detail"]


def test_a_pending_job_stops_at_once(two_nodes, token_client, sent_tasks, run) -> None:
    job = _started_job(run, token_client, layout="dp=2", start=False)
    response = run(token_client.post, f"/api/jobs/{job.pk}/stop")
    assert response.status_code == 200 and response.json()["state"] == "stopped"
    assert not sent_tasks


# --- reports ------------------------------------------------------------------------------

def test_report_flow_started_steps_stopped(two_nodes, token_client, sent_tasks, sent_events, run) -> None:
    job = _started_job(run, token_client, gpus=4)
    before = job_live_snapshot(job_id=job.pk)
    run(job_report, _report(job.pk, "started").model_dump(mode="json"))
    assert Job.objects.get(pk=job.pk).state == "running"
    for step in range(1, 5):  # step 4 trained, its loss lost with a peer (loss None)
        run(job_report, _report(job.pk, "step", step=step, loss=4.0 / step if step < 4 else None, step_seconds=0.5,
                                tokens_per_second=2048.0, layout="dp=4").model_dump(mode="json"))
    series = {s.name: s for s in job.metric_series.all()}
    assert set(series) == {"loss", "step_seconds", "tokens_per_second"}
    assert metric_points(series_id=series["loss"].pk) == ([1.0, 2.0, 3.0], [4.0, 2.0, 4.0 / 3])
    assert metric_points(series_id=series["step_seconds"].pk) == ([1.0, 2.0, 3.0, 4.0], [0.5] * 4)
    assert series["step_seconds"].unit == "s" and Job.objects.get(pk=job.pk).step == 4

    metrics = [e for e in sent_events if isinstance(e, MetricsEvent)]
    assert [(e.step, e.loss) for e in metrics] == [(1, 4.0), (2, 2.0), (3, 4.0 / 3), (4, None)]
    assert [b.seq - a.seq for a, b in zip(metrics, metrics[1:])] == [1, 1, 1]  # nothing else in between here
    for event in metrics:
        job_event_adapter.validate_python(event.model_dump(mode="json"))

    run(scheduling.job_stop, job_id=job.pk)
    assert Job.objects.get(pk=job.pk).state == "stopping"
    run(job_report, _report(job.pk, "stopped").model_dump(mode="json"))
    assert Job.objects.get(pk=job.pk).state == "stopped"
    assert set(_gpus().values()) == {("free", None)}

    # The job stream's snapshot invariant: snapshot(before) + events == snapshot(after).
    snapshot = before
    for event in sent_events:
        if isinstance(event, MetricsEvent):  # this job's stream, not the cluster's
            snapshot = apply_job_event(snapshot, event)
    after = job_live_snapshot(job_id=job.pk)
    assert snapshot == after and len(after.metrics["loss"].x) == 3
    live = token_client.get(f"/api/jobs/{job.pk}/live").json()
    assert live["seq"] == after.seq and live["metrics"]["loss"]["x"] == [1.0, 2.0, 3.0]


def test_a_step_before_started_and_a_stop_at_max_steps(two_nodes, token_client, sent_tasks, run) -> None:
    job = _started_job(run, token_client, layout="dp=2", max_steps=1)
    run(job_record_report, report=_report(job.pk, "step", step=1, loss=1.0))
    assert Job.objects.get(pk=job.pk).state == "running"
    run(job_record_report, report=_report(job.pk, "started"))  # late, harmless
    run(job_record_report, report=_report(job.pk, "stopped"))  # max_steps: no stop order was sent
    assert Job.objects.get(pk=job.pk).state == "stopped"
    assert {state for state, _ in _gpus().values()} == {"free"}


def test_failure_releases_gpus_and_stops_the_other_node(two_nodes, token_client, sent_tasks, run) -> None:
    job = _started_job(run, token_client, gpus=4)
    run(job_record_report, report=_report(job.pk, "started"))
    sent_tasks.clear()
    run(job_report, _report(job.pk, "failed", node="node-2", ranks=(2, 3),
                            error="rank 3 exited with code 1").model_dump(mode="json"))
    job.refresh_from_db()
    # node-1's ranks hold a full replica (dp=4): the job waits for them to report they outlived
    # their world (tests/controlplane/test_jobs_survivors.py); none does here, so it fails.
    assert job.state == "restoring"
    assert run(restore.job_restore, job_id=job.pk) is None
    job.refresh_from_db()
    assert job.state == "failed"
    assert job.error.startswith("node node-2 ranks 2, 3: rank 3 exited with code 1; no checkpoint to restore from")
    assert {state for state, _ in _gpus().values()} == {"free"}
    assert [(name, queue) for name, _, queue in sent_tasks if name != protocol.CONTROL_JOB_RESTORE] == [
        (protocol.NODE_JOB_STOP, "node.node-1")]


def test_late_and_unknown_reports_are_ignored(two_nodes, token_client, sent_tasks, run, caplog) -> None:
    caplog.set_level(logging.INFO)
    job = _started_job(run, token_client, layout="dp=2")
    run(job_record_report, report=_report(job.pk, "stopped"))
    late = {"step": {"step": 9, "loss": 0.1}, "started": {"step": 9}, "failed": {"error": "late"},
            "stopped": {"step": 9, "error": "late"}}
    for kind, fields in late.items():
        run(job_report, _report(job.pk, kind, **fields).model_dump(mode="json"))
    job.refresh_from_db()
    assert (job.state, job.error) == ("stopped", "")
    assert not job.metric_series.exists()
    assert "job j is stopped" in caplog.text
    assert run(job_record_report, report=_report(99999, "step", step=1, loss=1.0)) is None
    assert "job 99999 does not exist" in caplog.text
    run(job_report, {"job_id": job.pk, "node": "node-1", "kind": "exploded"})  # (sealed, as an agent of the job)
    assert "rejected job report" in caplog.text


def test_the_report_task_is_registered_with_the_control_worker() -> None:
    from controlplane.celery import app

    app.loader.import_default_modules()  # what the worker does at start (autodiscover_tasks)
    assert protocol.CONTROL_JOB_REPORT in app.tasks


# --- node loss ----------------------------------------------------------------------------

def test_losing_a_node_fails_its_jobs_and_frees_the_gpus(two_nodes, token_client, sent_tasks, run) -> None:
    job = _started_job(run, token_client, gpus=4)
    elsewhere = _started_job(run, token_client, "idle", layout="dp=1", start=False)
    run(job_record_report, report=_report(job.pk, "started"))
    sent_tasks.clear()
    later = dj_timezone.now() + timedelta(seconds=10)  # node-2 has been silent for 10 s, node-1 beats
    cluster.node_record_heartbeat(report=heartbeat("node-1", gpus=2, host="host-1"), received_at=later)
    lost = run(node_loss.nodes_lost_sweep, silent_for=timedelta(seconds=6), now=later)
    assert lost == ["node-2"]
    job.refresh_from_db()
    # node-2 went silent: node-1's ranks (whole replicas) would learn it at their step timeout
    # and report waiting; none does here, and the final look fails the job (no checkpoint).
    assert job.state == "restoring"
    run(restore.job_restore, job_id=job.pk)
    job.refresh_from_db()
    assert job.state == "failed"
    assert "node node-2 (ranks 2, 3) lost" in job.error
    gpus = _gpus()
    assert (gpus["node-1/0"], gpus["node-2/0"]) == (("free", None), ("lost", None))
    assert {queue for name, _, queue in sent_tasks if name == protocol.NODE_JOB_STOP} == {"node.node-1",
                                                                                          "node.node-2"}
    assert Job.objects.get(pk=elsewhere.pk).state == "pending"
    cluster.node_record_heartbeat(report=heartbeat("node-2", gpus=2, host="host-2"))
    assert {state for state, _ in _gpus().values()} == {"free"}


# --- schema -------------------------------------------------------------------------------

def test_schema_has_the_job_actions() -> None:
    from rest_framework.test import APIClient

    paths = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()["paths"]
    for path in ("/api/jobs/{id}/start", "/api/jobs/{id}/stop", "/api/jobs/{id}/live"):
        assert path in paths, path
    body = paths["/api/jobs"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("/JobCreate")


def test_an_empty_job_stream_snapshot() -> None:
    assert job_live_snapshot(job_id=12345) == JobLiveSnapshot(seq=0, metrics={})


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_metrics_reach_the_job_socket(user, two_nodes, sent_tasks) -> None:
    from channels.db import database_sync_to_async
    from channels.testing import WebsocketCommunicator
    from rest_framework.authtoken.models import Token

    from controlplane.asgi import application

    job = await database_sync_to_async(scheduling.job_submit)(name="ws", model="tiny-gpt", layout="dp=1")
    key = (await database_sync_to_async(Token.objects.create)(user=user)).key
    communicator = WebsocketCommunicator(application, f"/ws/jobs/{job.pk}/", headers=[
        (b"origin", b"http://localhost"), (b"host", b"localhost"), (b"authorization", f"Token {key}".encode())])
    connected, _ = await communicator.connect()
    assert connected
    hello = job_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    await database_sync_to_async(job_record_report)(report=_report(job.pk, "step", step=7, loss=2.5))
    event = job_event_adapter.validate_python(await communicator.receive_json_from(timeout=5))
    assert (event.type, event.op, event.seq, event.job, event.step, event.loss) == ("metrics", "append",
                                                                                     hello.seq + 1, job.pk, 7, 2.5)
    await communicator.disconnect()


def test_a_rendezvous_port_another_process_of_this_machine_holds_is_skipped(token_client, sent_tasks, run,
                                                                            settings) -> None:
    """Issue 11, item 4: a second stack on the same machine held the ports the database
    thought free, and every job failed to rendezvous. For a node on this machine, a port some
    process holds is skipped; a node elsewhere cannot be probed from here."""
    import socket

    from controlplane.cluster import services as cluster
    from tests.controlplane.conftest import heartbeat

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        settings.DYNAPLANE_RENDEZVOUS_PORTS = f"{port}-{port + 50}"
        cluster.node_record_heartbeat(report=heartbeat("local", gpus=1, host="127.0.0.1"))
        cluster.node_record_heartbeat(report=heartbeat("remote", gpus=1, host="host-far-away"))
        here = run(token_client.post, "/api/jobs", {"name": "here", "model": "tiny-gpt", "layout": "dp=1"},
                   format="json").json()
        assert here["placement"][0]["node"] == "local"
        assert here["rendezvous"].startswith("127.0.0.1:") and int(here["rendezvous"].rsplit(":", 1)[1]) > port
        far = run(token_client.post, "/api/jobs", {"name": "far", "model": "tiny-gpt", "layout": "dp=1"},
                  format="json").json()
        assert far["rendezvous"] == f"host-far-away:{port}"  # not probed: the database's view alone
