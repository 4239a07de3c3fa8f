"""Pre-flight before a start or a grow across hosts (issue 44), control-plane half: the orders
wait for every node's checks; a failed check or a silent node leaves the job as it was.

Real database; the agents are played by the test (their PreflightReports, sealed as theirs), and
the control plane's send_task is recorded. The agents' half runs for real in
tests/agents/test_preflight.py and, across network namespaces, in tests/integration/test_hosts.py.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone

from agents import protocol
from controlplane.cluster import services as cluster
from controlplane.cluster.models import Gpu
from controlplane.jobs import node_loss, preflight, reconcile, scheduling
from controlplane.jobs.models import Job, Preflight, Transition
from controlplane.jobs.preflight import Verdict, preflight_verdict
from controlplane.jobs.reports import job_record_report
from controlplane.jobs.tasks import preflight_report
from tests.controlplane.conftest import agent_key, heartbeat
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db

OK = ("storage", "data", "rendezvous", "all-reduce", "shared storage")


@pytest.fixture(autouse=True)
def _preflight_on(settings):
    settings.DYNAPLANE_PREFLIGHT = "hosts"


def _orders(sent, task) -> dict[str, dict]:
    return {queue: message for name, message, queue in sent if name == task}


def _report(order: dict, node: str, failed: dict[str, str] | None = None) -> dict:
    failed = failed or {}
    checks = []
    for name in OK:
        checks.append(protocol.PreflightCheck(name=name, ok=name not in failed, detail=failed.get(name, "fine")))
        if name in failed:
            break
    return protocol.PreflightReport(preflight_id=order["preflight_id"], job_id=order["job_id"], node=node,
                                    checks=tuple(checks), seconds=0.5).model_dump(mode="json")


def _create(run, token_client, **body) -> Job:
    response = run(token_client.post, "/api/jobs", {"name": "j", "model": "tiny-gpt", "global_batch": 12, **body},
                   format="json")
    assert response.status_code == 201, response.content
    return Job.objects.get(pk=response.json()["id"])


def _held_gpus() -> set[tuple[str, int]]:
    return {(g.node.name, g.index) for g in Gpu.objects.filter(job__isnull=False).select_related("node")}


def test_a_start_across_hosts_waits_for_every_node_to_pass(two_nodes, token_client, sent_tasks, run) -> None:
    job = _create(run, token_client, layout="dp=4")
    assert job.state == "starting" and job.nodes == ["node-1", "node-2"]
    assert not _orders(sent_tasks, protocol.NODE_JOB_START)  # no rank is ordered before the checks pass
    orders = _orders(sent_tasks, protocol.NODE_PREFLIGHT)
    assert set(orders) == {"node.node-1", "node.node-2"}
    order = protocol.PreflightOrder.model_validate(orders["node.node-1"])
    assert orders["node.node-1"] == orders["node.node-2"]  # one order, each node finds itself in it
    assert order.nodes == ("node-1", "node-2") and order.rendezvous == job.rendezvous == "host-1:29400"
    assert order.checkpoint_dir == job.checkpoint_dir and order.job_id == job.pk

    run(preflight_report, _report(orders["node.node-2"], "node-2"))
    assert not _orders(sent_tasks, protocol.NODE_JOB_START)  # node-1 has not reported yet
    long_ago = timezone.now() - timedelta(minutes=5)  # a slow pre-flight: the reconcile grace starts again at its end
    Job.objects.filter(pk=job.pk).update(updated_at=long_ago)
    run(preflight_report, _report(orders["node.node-1"], "node-1"))
    assert Job.objects.get(pk=job.pk).updated_at > long_ago + timedelta(minutes=4)
    starts = _orders(sent_tasks, protocol.NODE_JOB_START)
    assert set(starts) == {"node.node-1", "node.node-2"}
    row = Preflight.objects.get(job=job)
    assert row.state == "passed" and set(row.results) == {"node-1", "node-2"} and row.error == ""
    assert [e["node"] for e in row.nodes] == ["node-1", "node-2"] and row.nodes[1]["host"] == "host-2"
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    assert Job.objects.get(pk=job.pk).state == "running"


def test_a_failed_check_leaves_the_job_pending_with_gpus_and_port_free(two_nodes, token_client, sent_tasks,
                                                                        run) -> None:
    job = _create(run, token_client, layout="dp=4")
    order = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"]
    assert _held_gpus() == {("node-1", 0), ("node-1", 1), ("node-2", 0), ("node-2", 1)}
    run(preflight_report, _report(order, "node-1"))
    run(preflight_report, _report(order, "node-2", {"shared storage": "/ckpt/j/.probe is not here"}))

    job.refresh_from_db()
    assert job.state == "pending" and job.placement == [] and job.rendezvous == "" and job.rendezvous_port is None
    assert job.error == "pre-flight failed: host node-2 (host-2): shared storage: /ckpt/j/.probe is not here"
    assert _held_gpus() == set() and not _orders(sent_tasks, protocol.NODE_JOB_START)
    assert Preflight.objects.get(job=job).state == "failed"
    [shown] = token_client.get(f"/api/jobs/{job.pk}/preflights").json()
    assert (shown["state"], shown["error"], shown["transition"]) == ("failed", job.error, None)
    assert [(n["node"], n["host"], [c["name"] for c in n["checks"]]) for n in shown["nodes"]] == [
        ("node-1", "host-1", list(OK)), ("node-2", "host-2", list(OK))]
    assert shown["nodes"][1]["checks"][-1] == {"name": "shared storage", "ok": False,
                                               "detail": "/ckpt/j/.probe is not here"}

    sent_tasks.clear()  # started again: a new pre-flight, the old one's late reports change nothing
    response = run(token_client.post, f"/api/jobs/{job.pk}/start")
    assert response.status_code == 200 and response.json()["state"] == "starting", response.content
    again = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"]
    assert again["preflight_id"] != order["preflight_id"]
    run(preflight_report, _report(order, "node-2"))
    assert Job.objects.get(pk=job.pk).state == "starting" and not _orders(sent_tasks, protocol.NODE_JOB_START)


def test_a_node_that_never_answers_fails_the_preflight_by_name(two_nodes, token_client, sent_tasks, run) -> None:
    job = _create(run, token_client, layout="dp=4")
    order = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"]
    run(preflight_report, _report(order, "node-1"))
    assert run(preflight.preflights_time_out) == []  # not late yet
    later = timezone.now() + timedelta(seconds=preflight.deadline_seconds() + 1)
    assert reconcile.jobs_reconcile(grace=timedelta(0)) == []  # (no rank was ordered: the deadline rules)
    [ended] = run(preflight.preflights_time_out, now=later)
    job.refresh_from_db()
    assert ended == order["preflight_id"] and job.state == "pending" and _held_gpus() == set()
    assert "host node-2 (host-2): no report within" in job.error and "node-1" not in job.error


def test_stop_during_the_preflight_stops_the_job_and_ignores_late_reports(two_nodes, token_client, sent_tasks,
                                                                          run) -> None:
    job = _create(run, token_client, layout="dp=4")
    order = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"]
    run(scheduling.job_stop, job_id=job.pk)
    job.refresh_from_db()
    assert job.state == "stopped" and job.error == "" and _held_gpus() == set()
    for node in ("node-1", "node-2"):
        run(preflight_report, _report(order, node))
    assert Preflight.objects.get(job=job).state == "cancelled" and not _orders(sent_tasks, protocol.NODE_JOB_START)


def test_a_node_lost_during_a_start_preflight_sends_the_job_back_to_pending(two_nodes, token_client, sent_tasks,
                                                                            run) -> None:
    job = _create(run, token_client, layout="dp=4")
    with transaction.atomic():
        run(node_loss.jobs_on_node_loss, nodes=["node-2"])
    job.refresh_from_db()
    assert job.state == "pending" and "node node-2 (ranks 2, 3) lost during the pre-flight" in job.error
    assert Preflight.objects.get(job=job).state == "cancelled" and not _orders(sent_tasks, protocol.NODE_JOB_START)


def test_one_host_needs_no_preflight_unless_always(settings, token_client, sent_tasks, run) -> None:
    for i in (1, 2):  # two agents on one machine, as `make run` starts them
        cluster.node_record_heartbeat(report=heartbeat(f"node-{i}", gpus=2, host="127.0.0.1"))
        agent_key(f"node-{i}")
    job = _create(run, token_client, layout="dp=4")
    assert set(_orders(sent_tasks, protocol.NODE_JOB_START)) == {"node.node-1", "node.node-2"}
    assert not Preflight.objects.filter(job=job).exists()
    run(scheduling.job_stop, job_id=job.pk)
    run(job_record_report, report=report_of(job.pk, "stopped", "node-1"))

    settings.DYNAPLANE_PREFLIGHT = "always"
    sent_tasks.clear()
    one = _create(run, token_client, name="k", layout="dp=2", global_batch=8)
    order = protocol.PreflightOrder.model_validate(_orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"])
    assert order.nodes == ("node-1",) and not _orders(sent_tasks, protocol.NODE_JOB_START)
    run(preflight_report, _report(order.model_dump(mode="json"), "node-1"))
    assert set(_orders(sent_tasks, protocol.NODE_JOB_START)) == {"node.node-1"}
    assert Preflight.objects.get(job=one).state == "passed"


def test_a_grow_onto_another_host_waits_for_its_preflight(two_nodes, token_client, sent_tasks, run) -> None:
    job = _create(run, token_client, layout="dp=2")
    assert job.nodes == ["node-1"] and not Preflight.objects.exists()  # one host: no pre-flight
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    sent_tasks.clear()

    response = run(token_client.post, f"/api/jobs/{job.pk}/resize", {"layout": "dp=4"}, format="json")
    assert response.status_code == 202, response.content
    transition = Transition.objects.get(pk=response.json()["id"])
    assert not _orders(sent_tasks, protocol.NODE_JOB_SWITCH)
    order = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-2"]
    assert order["nodes"] == ["node-1", "node-2"] and order["rendezvous"] == transition.rendezvous == "host-1:29401"
    run(preflight_report, _report(order, "node-1"))
    run(preflight_report, _report(order, "node-2"))
    assert set(_orders(sent_tasks, protocol.NODE_JOB_SWITCH)) == {"node.node-1", "node.node-2"}
    assert Preflight.objects.get(transition=transition).state == "passed"


def test_a_failed_grow_preflight_aborts_the_resize_and_the_job_trains_on(two_nodes, token_client, sent_tasks,
                                                                         run) -> None:
    job = _create(run, token_client, layout="dp=2")
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    sent_tasks.clear()
    response = run(token_client.post, f"/api/jobs/{job.pk}/resize", {"layout": "dp=4"}, format="json")
    transition = Transition.objects.get(pk=response.json()["id"])
    order = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"]
    run(preflight_report, _report(order, "node-2", {"rendezvous": "cannot reach node-1's rendezvous host-1:29401"}))
    run(preflight_report, _report(order, "node-1", {"rendezvous": "node-2 did not join the rendezvous"}))

    transition.refresh_from_db()
    job.refresh_from_db()
    assert transition.state == "aborted" and job.state == "running" and job.layout == "dp=2"
    assert ("pre-flight failed: host node-1 (host-1): rendezvous: node-2 did not join the rendezvous; "
            "host node-2 (host-2): rendezvous: cannot reach node-1's rendezvous host-1:29401; "
            "the job trains on in dp=2") in transition.reason
    assert _held_gpus() == {("node-1", 0), ("node-1", 1)}  # the joining ranks' GPUs are free again
    assert not _orders(sent_tasks, protocol.NODE_JOB_SWITCH)


def test_a_report_from_a_node_that_does_not_serve_the_job_is_refused(two_nodes, token_client, sent_tasks,
                                                                     run) -> None:
    cluster.node_record_heartbeat(report=heartbeat("node-3", gpus=2, host="host-3"))
    job = _create(run, token_client, layout="dp=4")
    order = _orders(sent_tasks, protocol.NODE_PREFLIGHT)["node.node-1"]
    run(preflight_report, _report(order, "node-3", {"storage": "forged"}))  # sealed by node-3: not the job's
    assert Preflight.objects.get(job=job).results == {} and Job.objects.get(pk=job.pk).state == "starting"


def test_the_verdict_names_each_failed_host_and_waits_for_the_rest() -> None:
    nodes = [{"node": "a", "host": "10.0.0.1"}, {"node": "b", "host": "10.0.0.2"}, {"node": "c", "host": "c"}]
    good = {"checks": [{"name": "storage", "ok": True, "detail": ""}]}
    bad = {"checks": [{"name": "storage", "ok": True, "detail": ""}, {"name": "data", "ok": False, "detail": "gone"},
                      {"name": "port", "ok": False, "detail": "later failures are not named"}]}
    assert preflight_verdict(nodes, {"a": good, "b": bad}) == Verdict(None)
    assert preflight_verdict(nodes, {"a": good, "b": good, "c": good}) == Verdict(True)
    assert preflight_verdict(nodes, {"a": good, "b": bad, "c": good}) == Verdict(
        False, "pre-flight failed: host b (10.0.0.2): data: gone")
    verdict = preflight_verdict(nodes, {"b": bad}, timed_out=True)
    assert verdict.passed is False and verdict.error.startswith(
        "pre-flight failed: host a (10.0.0.1): no report within ")
    assert "; host b (10.0.0.2): data: gone; host c: no report within" in verdict.error
