"""The elastic scheduler's decisions carried out against the database (issue 31, second part):
controlplane/jobs/elastic_apply.py reads the cluster and the jobs, decides, and takes each
change through the resize and start paths users click; the layout history tells why.

Real PostgreSQL (or SQLite), real reports through the control plane's handlers; only
Celery's send_task is replaced by a recorder (no agent runs here).
"""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest
from django.db import connection
from django.utils import timezone as dj_timezone

from agents import protocol
from controlplane.cluster import services as cluster
from controlplane.jobs import elastic_trigger
from controlplane.jobs.elastic_apply import apply_change, elastic_sweep
from controlplane.jobs.elastic_state import elastic_plan, elastic_state
from controlplane.jobs.models import ElasticSweep, Job, Transition
from controlplane.jobs.reports import job_record_report, transition_record_report
from tests.controlplane.conftest import heartbeat
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db

LATER = timedelta(seconds=400)  # past the default 300 s interval


@pytest.fixture(autouse=True)
def _fresh_debounce():
    elastic_trigger.forget_queued()
    yield
    elastic_trigger.forget_queued()


@pytest.fixture
def four_nodes(db) -> None:
    """node-1 .. node-4 with two GPUs each (the issue's cluster)."""
    for i in range(1, 5):
        cluster.node_record_heartbeat(report=heartbeat(f"node-{i}", gpus=2, host=f"host-{i}"))


def submit(run, client, name: str, **body) -> Job:
    body = {"name": name, "model": "tiny-gpt", "global_batch": 12, **body}
    response = run(client.post, "/api/jobs", body, format="json")
    assert response.status_code == 201, response.content
    return Job.objects.get(pk=response.json()["id"])


def training(run, client, name: str, *, step_seconds: float = 0.2, **body) -> Job:
    """A job started through the API that reports `started` and three steps."""
    job = submit(run, client, name, **body)
    node = job.placement[0]["node"]
    run(job_record_report, report=report_of(job.pk, "started", node))
    for step in (1, 2, 3):
        run(job_record_report, report=report_of(job.pk, "step", node, step=step, step_seconds=step_seconds))
    job.refresh_from_db()
    assert job.state == "running"
    return job


def elastic_pair(run, client) -> tuple[Job, Job]:
    """Two elastic jobs on all 8 GPUs (2 to 4 GPUs each), started long enough ago to be resized."""
    a = training(run, client, "train-a", gpus=4, elastic=True, min_gpus=2, max_gpus=4)
    b = training(run, client, "train-b", gpus=4, elastic=True, min_gpus=2, max_gpus=4)
    Job.objects.filter(pk__in=[a.pk, b.pk]).update(started_at=dj_timezone.now() - timedelta(hours=1))
    return a, b


def report(t: Transition, state: str, **fields) -> protocol.TransitionReport:
    return protocol.TransitionReport(job_id=t.job_id, transition_id=t.pk, node=t.source_placement[0]["node"],
                                     state=state, sent_at=datetime.now(timezone.utc), **fields)


def commit(run, t: Transition) -> None:
    run(transition_record_report, report=report(t, "committed", step=9, pause_seconds=0.3, transfer_seconds=0.1,
                                                verify_seconds=0.05, network_bytes=0, rounds=1,
                                                fingerprint=t.plan_fingerprint, verified=True))
    t.refresh_from_db()
    assert t.state == "committed"
    node = t.destination_placement[0]["node"]
    for step in (10, 11, 12):  # and the job trains on in its new layout (a measured step time again)
        run(job_record_report, report=report_of(t.job_id, "step", node, step=step, step_seconds=0.2))


def sweep(run, now=None) -> dict[str, dict]:
    """One sweep, its orders sent as a commit would; job name -> its outcome."""
    return {o["job"]: o for o in run(elastic_sweep, why="test", now=now)}


def active(job: Job) -> Transition:
    return Transition.objects.get(job=job, state="planned")


def test_hand_off_elastic_jobs_shrink_for_a_priority_job_and_grow_back_when_it_ends(
        four_nodes, token_client, sent_tasks, run) -> None:
    """The issue's scenario, the control plane's half: two elastic jobs on 4 x 2 GPUs, a
    queued priority job; the elastic jobs shrink through the resize path, the priority job
    starts once their shrinks commit, and when it ends they grow back, each switch saying
    why in the layout history."""
    a, b = elastic_pair(run, token_client)
    sent_tasks.clear()
    elastic_trigger.forget_queued()  # (the sweep their start queued would have run by now)
    evaluation = submit(run, token_client, "eval", gpus=4, priority=10, queue=True)
    assert (evaluation.state, evaluation.queued, evaluation.gpus.count()) == ("pending", True, 0)
    assert [args for name, args, _ in sent_tasks if name == protocol.CONTROL_SWEEP_ELASTIC] == ["job eval pending"]

    plan = token_client.get("/api/elastic").json()
    assert {d["job"]: (d["kind"], d["gpus_to"]) for d in plan["decisions"]} == {
        "eval": ("start", 4), "train-a": ("shrink", 2), "train-b": ("shrink", 2)}
    assert {j["name"]: (j["min_gpus"], j["max_gpus"], j["priority"], j["elastic"]) for j in plan["jobs"]} == {
        "train-a": (2, 4, 0, True), "train-b": (2, 4, 0, True), "eval": (4, 4, 10, False)}

    sent_tasks.clear()
    first = sweep(run)
    assert {job: o["outcome"] for job, o in first.items()} == {"train-a": "applied", "train-b": "applied",
                                                                "eval": "waits"}
    shrink_a, shrink_b = active(a), active(b)
    for t in (shrink_a, shrink_b):
        assert (t.source_world, t.destination_world, t.destination_layout) == (4, 2, "dp=2")
        assert t.reason == "shrank to 2 (dp=2): job 'eval' (priority 10) needed 4 GPUs"
    assert {q for name, _, q in sent_tasks if name == protocol.NODE_JOB_SWITCH} == {
        "node.node-1", "node.node-2", "node.node-3", "node.node-4"}

    assert sweep(run) == {}  # the same state: nothing more (the shrinking jobs are busy; eval waits)
    assert Transition.objects.count() == 2

    commit(run, shrink_a)
    after_one = sweep(run)
    assert after_one == {}  # train-a just shrank (its interval), train-b switches, eval needs 4 of 2 free
    waiting = token_client.get("/api/elastic").json()["waiting"]
    assert waiting == [{"job_id": evaluation.pk, "job": "eval",
                        "reason": "waiting: needs 4 GPUs at priority 10; 2 free after this decision"}]

    commit(run, shrink_b)
    started = sweep(run)
    assert started["eval"]["outcome"] == "applied" and set(started) == {"eval"}
    evaluation.refresh_from_db()
    assert evaluation.state == "starting"
    assert sorted({s["node"] for s in evaluation.placement}) == ["node-2", "node-4"]  # the GPUs the shrinks freed

    run(job_record_report, report=report_of(evaluation.pk, "started", "node-2"))
    run(job_record_report, report=report_of(evaluation.pk, "stopped", "node-2", step=5))
    assert Job.objects.get(pk=evaluation.pk).state == "stopped"
    assert sweep(run) == {}  # they shrank moments ago: the interval holds them
    back = sweep(run, now=dj_timezone.now() + LATER)
    assert {job: (o["kind"], o["gpus_to"], o["outcome"]) for job, o in back.items()} == {
        "train-a": ("grow", 4, "applied"), "train-b": ("grow", 4, "applied")}
    for job in (a, b):
        grow = active(job)
        assert grow.reason.startswith("grew to 4 (dp=4): job 'eval' (priority 10) ended; pays its 0.2 s pause "
                                      "back ("), grow.reason
        commit(run, grow)
        job.refresh_from_db()
        assert (job.state, job.world_size, job.layout, job.resize_failures) == ("running", 4, "dp=4", 0)
    story = [t.reason.split(":")[0] for t in Transition.objects.filter(job=a).order_by("created_at")]
    assert story == ["shrank to 2 (dp=2)", "grew to 4 (dp=4)"]


def test_a_failed_resize_backs_off_and_a_committed_one_resets_the_count(
        four_nodes, token_client, sent_tasks, run, settings) -> None:
    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    job = training(run, token_client, "grow", gpus=2, elastic=True, min_gpus=2, max_gpus=4)
    grow = sweep(run)["grow"]
    assert (grow["kind"], grow["gpus_to"], grow["outcome"]) == ("grow", 4, "applied")
    run(transition_record_report, report=report(active(job), "aborted", error="joining rank 2 died"))
    job.refresh_from_db()
    assert (job.state, job.world_size, job.resize_failures) == ("running", 2, 1)

    assert sweep(run) == {}  # backing off: 60 s after one failure
    frozen = {j["name"]: j for j in token_client.get("/api/elastic").json()["jobs"]}["grow"]
    assert frozen["frozen"].startswith("backing off after 1 failed resize(s)") and frozen["backoff_until"]
    assert sweep(run, now=dj_timezone.now() + timedelta(seconds=30)) == {}
    retry = sweep(run, now=dj_timezone.now() + timedelta(seconds=61))["grow"]
    assert retry["outcome"] == "applied"
    commit(run, active(job))
    job.refresh_from_db()
    assert (job.world_size, job.resize_failures) == (4, 0)


def test_a_resize_the_path_refuses_counts_as_a_failure(four_nodes, token_client, sent_tasks, run, settings) -> None:
    """One rendezvous port, held by the job itself: the resize path answers 409 (no port for
    the union world); the sweep records the refusal, and the job backs off."""
    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    settings.DYNAPLANE_RENDEZVOUS_PORTS = "29400-29400"
    job = training(run, token_client, "one-port", gpus=2, elastic=True, min_gpus=2, max_gpus=4)
    refused = sweep(run)["one-port"]
    assert refused["outcome"] == "refused" and "rendezvous ports 29400-29400" in refused["detail"], refused
    job.refresh_from_db()
    assert (job.state, job.resize_failures, Transition.objects.filter(job=job).count()) == ("running", 1, 0)
    assert job.resize_failed_at is not None
    assert sweep(run) == {}  # backing off
    assert ElasticSweep.objects.get(pk=1).outcomes == []


def test_only_elastic_jobs_are_resized_and_the_switch_turns_it_on(
        four_nodes, token_client, sent_tasks, run, settings) -> None:
    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    job = training(run, token_client, "rigid", gpus=2, max_gpus=8)  # a range, but the policy switch off
    sent_tasks.clear()
    assert sweep(run) == {}  # (no elastic or queued job: not even a look)
    assert not [t for t in sent_tasks if t[0] == protocol.CONTROL_SWEEP_ELASTIC]
    response = run(token_client.patch, f"/api/jobs/{job.pk}/elastic", {"elastic": True}, format="json")
    assert response.status_code == 200
    assert [t[0] for t in sent_tasks] == [protocol.CONTROL_SWEEP_ELASTIC]  # the switch nudges the scheduler
    grown = sweep(run)["rigid"]
    assert (grown["kind"], grown["gpus_to"], grown["outcome"]) == ("grow", 8, "applied")
    assert active(job).reason.startswith("grew to 8 (tp=2,dp=4): 6 GPUs free; pays its")  # (12 samples: no dp=8)


def test_a_grow_onto_a_node_that_joined_says_so(four_nodes, token_client, sent_tasks, run, settings) -> None:
    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    training(run, token_client, "filler", gpus=4)
    job = training(run, token_client, "wide", gpus=4, elastic=True, min_gpus=2, max_gpus=6)
    assert sweep(run) == {}  # no GPU free
    assert elastic_trigger.nudge_for_joined_nodes() == []
    sent_tasks.clear()
    elastic_trigger.forget_queued()
    run(cluster.node_record_heartbeat, report=heartbeat("node-5", gpus=2, host="host-5"))
    assert run(elastic_trigger.nudge_for_joined_nodes) == ["node-5"]
    assert [args for name, args, _ in sent_tasks if name == protocol.CONTROL_SWEEP_ELASTIC] == ["node node-5 joined"]
    grown = sweep(run)["wide"]
    assert grown["outcome"] == "applied"
    assert active(job).reason.startswith("grew to 6 (dp=6): node-5 joined; pays its")
    assert elastic_trigger.nudge_for_joined_nodes() == []  # the sweep has seen it


def test_a_change_to_a_job_that_moved_since_the_decision_is_skipped(
        four_nodes, token_client, sent_tasks, run, settings) -> None:
    """A user's resize between the read and the change: the sweep leaves the job alone (one
    active transition per job, whoever asked)."""
    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    job = training(run, token_client, "clicked", gpus=2, elastic=True, min_gpus=2, max_gpus=4)
    state = elastic_state()
    (change,) = elastic_plan(state).changes
    assert run(token_client.post, f"/api/jobs/{job.pk}/resize", {"gpus": 3}, format="json").status_code == 202
    outcome = apply_change(change, dj_timezone.now())
    assert (outcome["outcome"], outcome["detail"]) == ("skipped", "job 'clicked' is switching"), outcome
    assert Transition.objects.filter(job=job).count() == 1 and Job.objects.get(pk=job.pk).resize_failures == 0


def test_a_job_a_click_put_below_its_minimum_grows_back_to_it(four_nodes, token_client, sent_tasks, run,
                                                             settings) -> None:
    """min_gpus=4 and no max: the range follows world_size, which a user's resize to 2 puts
    below the minimum; the scheduler still sees the job and brings it back to 4."""
    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    job = training(run, token_client, "clicked-down", gpus=4, elastic=True, min_gpus=4)
    assert sweep(run) == {}
    assert run(token_client.post, f"/api/jobs/{job.pk}/resize", {"gpus": 2}, format="json").status_code == 202
    commit(run, active(job))
    back = sweep(run)["clicked-down"]
    assert (back["kind"], back["gpus_to"], back["outcome"]) == ("grow", 4, "applied")
    assert active(job).reason.startswith("grew to 4 (dp=4): 2 GPUs free; pays its")
    assert {j["name"]: (j["min_gpus"], j["max_gpus"]) for j in token_client.get("/api/elastic").json()["jobs"]} == {
        "clicked-down": (4, 4)}


def test_queueing_is_an_explicit_choice(four_nodes, token_client, sent_tasks, run) -> None:
    response = run(token_client.post, "/api/jobs", {"name": "both", "model": "tiny-gpt", "gpus": 2,
                                                    "queue": True, "start": False}, format="json")
    assert response.status_code == 400 and "a queued job is started by the elastic scheduler" in \
        response.json()["queue"][0]
    pending = submit(run, token_client, "later", gpus=2, start=False)
    assert sweep(run) == {}  # a pending job that is not queued waits for POST start
    assert Job.objects.get(pk=pending.pk).state == "pending"
    queued = submit(run, token_client, "queued", gpus=2, queue=True)
    assert sweep(run)["queued"]["outcome"] == "applied"
    assert Job.objects.get(pk=queued.pk).state == "starting" and Job.objects.get(pk=pending.pk).state == "pending"


def test_a_range_far_wider_than_the_cluster_costs_only_the_clusters_sizes(token_client, run) -> None:
    """Before any agent registers, a range is not checked against the cluster: a queued
    job may ask for up to 65,536 GPUs. The plan ranks layouts only for counts the cluster
    has (none here), so it answers at once, and the job waits saying why."""
    import time

    submit(run, token_client, "huge", gpus=2, elastic=True, min_gpus=2, max_gpus=65536, queue=True)
    started = time.monotonic()
    plan = token_client.get("/api/elastic").json()
    assert time.monotonic() - started < 5
    (job,) = plan["jobs"]
    assert (job["name"], job["max_gpus"], job["options"], plan["gpus"]) == ("huge", 65536, [], 0)
    assert plan["waiting"] == [{"job_id": job["id"], "job": "huge",
                                "reason": "waiting: needs 2 GPUs at priority 0; 0 free after this decision"}]
    assert run(elastic_sweep) == []


def test_nudges_are_debounced_and_only_sent_when_the_scheduler_has_work(
        four_nodes, token_client, sent_tasks, run) -> None:
    training(run, token_client, "plain", gpus=2)
    run(token_client.post, "/api/jobs", {"name": "other", "model": "tiny-gpt", "gpus": 2}, format="json")
    assert not [t for t in sent_tasks if t[0] == protocol.CONTROL_SWEEP_ELASTIC]  # no elastic job: no sweep
    training(run, token_client, "stretchy", gpus=2, elastic=True, max_gpus=4)
    nudges = [args for name, args, _ in sent_tasks if name == protocol.CONTROL_SWEEP_ELASTIC]
    assert nudges == ["job stretchy starting"]  # started, then running: one sweep queued, due after both


def test_the_plan_is_in_the_openapi_schema(token_client) -> None:
    schema = token_client.get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    get = schema["paths"]["/api/elastic"]["get"]
    ref = get["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
    plan = schema["components"]["schemas"][ref]["properties"]
    assert {"jobs", "decisions", "waiting", "settings", "last_sweep"} <= set(plan)
    decision = schema["components"]["schemas"]["ElasticDecision"]["properties"]
    assert {"reason", "gain_seconds", "pause_seconds", "step_seconds"} <= set(decision)
    assert "queue" in schema["components"]["schemas"]["JobCreate"]["properties"]


@pytest.mark.django_db(transaction=True)
def test_concurrent_sweeps_never_resize_a_job_twice(four_nodes, sent_tasks, settings) -> None:
    if connection.vendor != "postgresql":
        pytest.skip("row locks are a PostgreSQL matter (SQLite serializes all writers)")
    from controlplane.jobs import scheduling

    settings.DYNAPLANE_ELASTIC_MIN_INTERVAL_SECONDS = 0
    jobs = [scheduling.job_submit(name=f"e{i}", model="tiny-gpt", gpus=2, global_batch=12, elastic=True,
                                  max_gpus=4) for i in range(2)]
    for job in jobs:
        job_record_report(report=report_of(job.pk, "started", job.placement[0]["node"]))
        job_record_report(report=report_of(job.pk, "step", job.placement[0]["node"], step=1, step_seconds=0.2))
    barrier = threading.Barrier(4)
    outcomes: list[list[dict]] = []

    def go() -> None:
        try:
            barrier.wait(timeout=10)
            outcomes.append(elastic_sweep(why="race"))
        finally:
            connection.close()

    threads = [threading.Thread(target=go) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert len(outcomes) == 4
    applied = [o for sweep_ in outcomes for o in sweep_ if o["outcome"] == "applied"]
    assert sorted(o["job"] for o in applied) == ["e0", "e1"]  # each grown once, by one of the sweeps
    assert sorted(Transition.objects.values_list("job__name", flat=True)) == ["e0", "e1"]
