"""Online resize, control-plane half (issue 6): POST /api/jobs/{id}/resize plans the switch,
places the joining ranks, sends every involved node its JobSwitchOrder; transition reports
move the transition and, at commit, the job.

Real PostgreSQL (or SQLite) and Redis; only the control plane's Celery send_task is
replaced, by a recorder, since no agent runs here.
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import call_command
from django.utils import timezone as dj_timezone

from agents import protocol
from tests.support.reports import report_of
from parallelism.layout.catalog import get_model
from controlplane.cluster import services as cluster
from controlplane.cluster.events import JobEvent
from controlplane.cluster.models import Gpu
from controlplane.jobs import node_loss, scheduling
from controlplane.jobs.orders import free_port
from controlplane.jobs.events import TransitionEvent, apply_job_event, job_event_adapter
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.reports import job_record_report, transition_record_report
from controlplane.jobs.layouts import layout_for_resize
from controlplane.jobs.selectors import job_live_snapshot
from controlplane.jobs.tasks import transition_report
from tests.controlplane.conftest import heartbeat

pytestmark = pytest.mark.django_db


def running_job(run, token_client, name="j", **body) -> Job:
    body = {"name": name, "model": "tiny-gpt", "global_batch": 12, **body}
    response = run(token_client.post, "/api/jobs", body, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(pk=response.json()["id"])
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    job.refresh_from_db()
    assert job.state == "running"
    return job


def resize_job(run, token_client, job: Job, **body):
    return run(token_client.post, f"/api/jobs/{job.pk}/resize", body, format="json")


def _switch_orders(sent) -> dict[str, protocol.JobSwitchOrder]:
    return {queue: protocol.JobSwitchOrder.model_validate(message)
            for name, message, queue in sent if name == protocol.NODE_JOB_SWITCH}


def treport(t: Transition | dict, state: str, node: str = "node-1", **fields) -> dict:
    job_id, tid = (t.job_id, t.pk) if isinstance(t, Transition) else (t["job_id"], t["id"])
    return protocol.TransitionReport(job_id=job_id, transition_id=tid, node=node, state=state,
                                     sent_at=datetime.now(timezone.utc), **fields).model_dump(mode="json")


def gpu_states() -> dict[str, tuple[str, str | None]]:
    return {f"{g.node.name}/{g.index}": (g.state, g.job.name if g.job else None)
            for g in Gpu.objects.select_related("node", "job")}


def _slots(order: protocol.JobSwitchOrder) -> list[tuple[int, int]]:
    return [(s.rank, s.gpu) for s in order.ranks]


def _committed(t: Transition, **extra) -> dict:
    return treport(t, "committed", step=7, pause_seconds=0.9, transfer_seconds=0.5, verify_seconds=0.1,
                    network_bytes=123456, rounds=2, peak_bytes=9000, predicted_peak_bytes=8800,
                    fingerprint=t.plan_fingerprint, verified=True, **extra)


# --- grow -----------------------------------------------------------------------------------

def test_grow_from_two_to_four_ranks_across_two_nodes(two_nodes, token_client, sent_tasks, sent_events,
                                                      run) -> None:
    job = running_job(run, token_client, layout="dp=2")
    assert [s["node"] for s in job.placement] == ["node-1", "node-1"] and job.rendezvous == "host-1:29400"
    before = job_live_snapshot(job_id=job.pk)
    sent_tasks.clear()
    sent_events.clear()

    response = resize_job(run, token_client, job, layout="tp=2,dp=2")
    assert response.status_code == 202, response.content
    body = response.json()
    assert (body["job"], body["job_id"], body["state"]) == ("j", job.pk, "planned")
    assert (body["source_layout"], body["destination_layout"]) == ("dp=2", "tp=2,dp=2")
    assert (body["source_world"], body["destination_world"]) == (2, 4)
    assert body["destination_placement"] == [
        {"rank": 0, "node": "node-1", "gpu": 0}, {"rank": 1, "node": "node-1", "gpu": 1},
        {"rank": 2, "node": "node-2", "gpu": 0}, {"rank": 3, "node": "node-2", "gpu": 1}]
    assert body["source_placement"] == job.placement
    assert body["rendezvous"] == "host-1:29401"  # rank 0's host, a port the job's start store does not hold
    assert len(body["plan_fingerprint"]) == 64 and body["plan_summary"]["fingerprint"] == body["plan_fingerprint"]
    assert (body["plan_summary"]["world_src"], body["plan_summary"]["world_dst"]) == (2, 4)
    assert (body["gpus_per_node"], body["staging_bytes"]) == (2, 64 * 2**20)
    assert Job.objects.get(pk=job.pk).state == "switching"
    assert set(gpu_states().values()) == {("allocated", "j")}  # the joining ranks' GPUs, taken at once

    orders = _switch_orders(sent_tasks)
    assert set(orders) == {"node.node-1", "node.node-2"}
    assert _slots(orders["node.node-1"]) == [(0, 0), (1, 1)]  # staying ranks
    assert _slots(orders["node.node-2"]) == [(2, 0), (3, 1)]  # joining ranks
    for order in orders.values():
        assert (order.job_id, order.transition_id, order.job_name, order.model) == (job.pk, body["id"], "j", "tiny-gpt")
        assert (order.src_layout, order.src_world, order.layout, order.world) == ("dp=2", 2, "tp=2,dp=2", 4)
        assert (order.global_batch, order.micro_batch, order.seq, order.max_steps) == (12, 1, 128, None)
        assert (order.rendezvous, order.gpus_per_node, order.staging_bytes) == ("host-1:29401", 2, 64 * 2**20)

    t = Transition.objects.get(pk=body["id"])
    run(transition_report, treport(t, "preparing"))
    run(transition_report, treport(t, "ready", step=6, prepare_seconds=1.5))
    run(transition_report, treport(t, "transferring", step=6))
    assert Transition.objects.get(pk=t.pk).state == "transferring"
    run(transition_report, _committed(t, phases={"hand_over": 0.01, "transfer": 0.5, "trainer": 0.3}))  # skips verifying

    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "committed"
    assert t.verification["phases"] == {"hand_over": 0.01, "transfer": 0.5, "trainer": 0.3}  # where the pause went
    assert [(h["state"], h["reported"]) for h in t.history] == [
        ("planned", False), ("preparing", True), ("ready", True), ("transferring", True), ("verifying", False),
        ("committed", True)]
    assert t.started_at is not None and t.finished_at >= t.started_at
    assert (t.prepare_seconds, t.pause_seconds, t.transfer_seconds, t.verify_seconds) == (1.5, 0.9, 0.5, 0.1)
    assert (t.network_bytes, t.rounds, t.peak_bytes, t.predicted_peak_bytes, t.step) == (123456, 2, 9000, 8800, 7)
    assert t.verification == {"verified": True, "fingerprint": t.plan_fingerprint, "matches_plan": True,
                              "node": "node-1", "tensors": None,
                              "phases": {"hand_over": 0.01, "transfer": 0.5, "trainer": 0.3}}
    assert (job.state, job.layout, job.world_size) == ("running", "tp=2,dp=2", 4)
    assert job.placement == body["destination_placement"]
    # The job keeps its start rendezvous: rank 0's process still holds that store.
    assert (job.rendezvous, job.rendezvous_port) == ("host-1:29400", 29400)
    assert set(gpu_states().values()) == {("allocated", "j")}

    # Live: every transition change on the job's stream, in seq order; job states on the cluster stream.
    moves = [e for e in sent_events if isinstance(e, TransitionEvent)]
    assert [e.transition.state for e in moves] == ["planned", "preparing", "ready", "transferring", "committed"]
    assert [e.seq for e in moves] == list(range(before.seq + 1, before.seq + 6))
    for event in moves:
        job_event_adapter.validate_python(event.model_dump(mode="json"))
    assert moves[-1].transition.verified is True and moves[-1].transition.destination_world == 4
    jobs = [e.job for e in sent_events if isinstance(e, JobEvent)]
    assert [(j.state, j.layout, j.gpus) for j in jobs] == [("switching", "dp=2", 2), ("running", "tp=2,dp=2", 4)]
    snapshot = before
    for event in moves:
        snapshot = apply_job_event(snapshot, event)
    assert snapshot == job_live_snapshot(job_id=job.pk)
    live = token_client.get(f"/api/jobs/{job.pk}/live").json()
    assert [t["state"] for t in live["transitions"]] == ["committed"]

    # The layout history, by job id or name.
    for key in (str(job.pk), "j"):
        listed = token_client.get(f"/api/transitions?job={key}").json()
        rows = listed["results"] if isinstance(listed, dict) else listed
        assert [(r["id"], r["state"], r["network_bytes"]) for r in rows] == [(t.pk, "committed", 123456)]
        assert rows[0]["destination_placement"] == job.placement and rows[0]["history"][-1]["state"] == "committed"
    listed = token_client.get("/api/transitions?job=nope").json()
    assert (listed["results"] if isinstance(listed, dict) else listed) == []

    # Neither the start port nor the committed transition's is given out while the job lives:
    # rank 0 keeps every store it served open (a resize given the start port failed with
    # EADDRINUSE in the stack test).
    assert free_port() == 29402


def test_gpus_grow_picks_dp_and_the_most_free_node(two_nodes, token_client, sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=1")
    response = resize_job(run, token_client, job, gpus=3)
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["destination_layout"] == "dp=3"
    # rank 1 and 2 join: node-2 has the most free GPUs
    assert [(s["rank"], s["node"], s["gpu"]) for s in body["destination_placement"]] == [
        (0, "node-1", 0), (1, "node-2", 0), (2, "node-2", 1)]
    orders = _switch_orders(sent_tasks)
    assert (_slots(orders["node.node-1"]), _slots(orders["node.node-2"])) == ([(0, 0)], [(1, 0), (2, 1)])


def test_the_gpus_rule_keeps_tp_and_pp_when_it_can() -> None:
    job = Job(name="r", model="tiny-gpt", layout="tp=2,dp=1", world_size=2, global_batch=12, micro_batch=1)
    tiny = get_model("tiny-gpt")
    assert layout_for_resize(job, 4, tiny) == "tp=2,dp=2"
    assert layout_for_resize(job, 6, tiny) == "tp=2,dp=3"
    assert layout_for_resize(job, 3, tiny) == "dp=3"  # 3 GPUs cannot keep tp=2
    job.global_batch = 8
    assert layout_for_resize(job, 6, tiny) == "dp=6"  # dp=3 breaks the batch rule; dp=6 does too, and says so later
    job.layout = "tp=2,pp=2,dp=1,zero=1"
    job.global_batch = 12
    assert layout_for_resize(job, 8, tiny) == "tp=2,pp=2,dp=2,zero=1"


# --- shrink ---------------------------------------------------------------------------------

def test_shrink_from_four_to_three_frees_the_leaving_rank_at_commit(two_nodes, token_client, sent_tasks,
                                                                    run) -> None:
    job = running_job(run, token_client, gpus=4)
    sent_tasks.clear()
    response = resize_job(run, token_client, job, gpus=3)
    assert response.status_code == 202, response.content
    t = Transition.objects.get(pk=response.json()["id"])
    assert (t.destination_layout, t.destination_world) == ("dp=3", 3)
    assert [s["rank"] for s in t.destination_placement] == [0, 1, 2]
    orders = _switch_orders(sent_tasks)
    assert _slots(orders["node.node-1"]) == [(0, 0), (1, 1)]
    assert _slots(orders["node.node-2"]) == [(2, 0), (3, 1)]  # rank 3 leaves after handing over
    assert gpu_states()["node-2/1"] == ("allocated", "j")  # held until the commit

    run(transition_report, _committed(t))  # straight from planned: preparing .. verifying passed through
    t.refresh_from_db()
    job.refresh_from_db()
    assert [h["state"] for h in t.history] == ["planned", "preparing", "ready", "transferring", "verifying",
                                               "committed"]
    assert (job.state, job.layout, job.world_size, len(job.placement)) == ("running", "dp=3", 3, 3)
    gpus = gpu_states()
    assert gpus["node-2/1"] == ("free", None)
    assert [gpus[k] for k in ("node-1/0", "node-1/1", "node-2/0")] == [("allocated", "j")] * 3


# --- the device map ---------------------------------------------------------------------------

def test_a_shrink_keeps_each_gpus_pipeline_stage_under_the_device_map(two_nodes, token_client, sent_tasks,
                                                                       run) -> None:
    """pp=2,dp=2 -> pp=2: in the contract's order rank 1 (stage 1) would go to process 1,
    which holds stage 0, and the whole stage would cross the network; the map gives it to
    process 2 (node-2/0), which holds stage 1 already: nothing moves."""
    job = running_job(run, token_client, layout="pp=2,dp=2")
    assert [(s["node"], s["gpu"]) for s in job.placement] == [
        ("node-1", 0), ("node-1", 1), ("node-2", 0), ("node-2", 1)]
    sent_tasks.clear()
    response = resize_job(run, token_client, job, layout="pp=2")
    assert response.status_code == 202, response.content
    body = response.json()
    assert body["plan_summary"]["network_bytes"] == 0 < body["plan_summary"]["contract_order_network_bytes"]
    assert body["plan_summary"]["ranks_renumbered"] == 1
    assert body["destination_placement"] == [{"rank": 0, "node": "node-1", "gpu": 0},
                                             {"rank": 1, "node": "node-2", "gpu": 0}]
    t = Transition.objects.get(pk=body["id"])
    assert t.process_of == body["process_of"] == [0, 2]
    orders = _switch_orders(sent_tasks)
    assert _slots(orders["node.node-1"]) == [(0, 0), (1, 1)] and _slots(orders["node.node-2"]) == [(2, 0), (3, 1)]
    for order in orders.values():
        assert order.process_of == (0, 2)
        assert [order.rank_of(p) for p in range(4)] == [0, None, 1, None]
    # The plan the transition's page shows is the one it ran (same map, same fingerprint).
    assert token_client.get(f"/api/transitions/{t.pk}/plan").json()["summary"]["fingerprint"] == t.plan_fingerprint

    run(transition_report, _committed(t))
    job.refresh_from_db()
    assert (job.layout, job.placement) == ("pp=2", body["destination_placement"])
    gpus = gpu_states()  # the GPUs of the processes that took no rank are free; the others stay the job's
    assert (gpus["node-1/1"], gpus["node-2/1"]) == (("free", None), ("free", None))
    assert (gpus["node-1/0"], gpus["node-2/0"]) == (("allocated", "j"), ("allocated", "j"))


def test_a_grow_places_the_joining_processes_and_maps_the_ranks(two_nodes, token_client, sent_tasks, run) -> None:
    """pp=2 -> pp=2,dp=2: process 1 (stage 1) takes rank 2 (stage 1 of the second
    replica is rank 3, of the first rank 1 ... the map decides; the test checks that each
    rank runs where its process runs and that an undo frees exactly the joining GPUs)."""
    job = running_job(run, token_client, layout="pp=2")
    sent_tasks.clear()
    response = resize_job(run, token_client, job, layout="pp=2,dp=2")
    assert response.status_code == 202, response.content
    t = Transition.objects.get(pk=response.json()["id"])
    assert t.process_of is not None and t.process_of[0] == 0 and sorted(t.process_of) == [0, 1, 2, 3]
    assert t.plan_summary["network_bytes"] < t.plan_summary["contract_order_network_bytes"]
    orders = _switch_orders(sent_tasks)
    union = {s.rank: (node, s.gpu) for node, order in orders.items() for s in order.ranks}
    assert union == {0: ("node.node-1", 0), 1: ("node.node-1", 1), 2: ("node.node-2", 0), 3: ("node.node-2", 1)}
    for slot in t.destination_placement:
        node, gpu = union[t.process_of[slot["rank"]]]
        assert (slot["node"], slot["gpu"]) == (node.removeprefix("node."), gpu)
    run(transition_report, treport(t, "aborted", error="the joining ranks never came"))
    gpus = gpu_states()
    assert (gpus["node-2/0"], gpus["node-2/1"]) == (("free", None), ("free", None))
    assert (gpus["node-1/0"], gpus["node-1/1"]) == (("allocated", "j"), ("allocated", "j"))


# --- refusals -------------------------------------------------------------------------------

def test_a_second_resize_while_one_is_active_is_a_conflict(two_nodes, token_client, sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=2")
    assert resize_job(run, token_client, job, gpus=3).status_code == 202
    response = resize_job(run, token_client, job, gpus=4)
    assert response.status_code == 409
    assert "a transition is already active" in response.json()["detail"]
    assert Transition.objects.filter(job=job).count() == 1


def test_refusals_say_why(two_nodes, token_client, sent_tasks, run) -> None:
    pending = scheduling.job_submit(name="p", model="tiny-gpt", layout="dp=1", start=False)
    response = resize_job(run, token_client, pending, gpus=2)
    assert (response.status_code, response.json()["detail"]) == (
        409, "job 'p' is pending; only a running job can be resized")

    job = running_job(run, token_client, layout="dp=1", global_batch=8)
    for body in ({}, {"gpus": 2, "layout": "dp=2"}):
        response = resize_job(run, token_client, job, **body)
        assert response.status_code == 400 and "either `layout` or `gpus`" in response.json()["layout"][0]
    response = resize_job(run, token_client, job, layout="tp=3")
    assert response.status_code == 400 and "tp=3 does not divide" in response.json()["layout"][0]
    response = resize_job(run, token_client, job, layout="tp=two")
    assert response.status_code == 400 and "not a non-negative integer" in response.json()["layout"][0]
    response = resize_job(run, token_client, job, layout="tp=4")  # 2 kv heads replicated: trainable, but
    assert response.status_code == 409  # a TP group must share a node and 4 free GPUs span two
    assert "joining ranks 1-3 must run on node node-1 with ranks 0 of their tensor-parallel block" in \
        response.json()["detail"]
    response = resize_job(run, token_client, job, gpus=3)
    assert response.status_code == 400
    assert response.json()["global_batch"] == [
        "global_batch=8 is not a multiple of micro_batch=1 x dp=3 (layout dp=3)"]
    response = resize_job(run, token_client, job, gpus=8)
    assert response.status_code == 409
    assert "joining ranks 1-7 cannot be placed" in response.json()["detail"]
    assert "3 free in all" in response.json()["detail"]  # the AllocationError's numbers
    response = resize_job(run, token_client, job, layout="dp=1")
    assert response.status_code == 409 and "nothing to switch" in response.json()["detail"]
    assert not Transition.objects.exists() and not sent_tasks[1:]  # only the start order went out
    assert Job.objects.get(pk=job.pk).state == "running"
    assert sorted(k for k, (state, _) in gpu_states().items() if state == "allocated") == ["node-1/0"]


def test_tensor_parallel_blocks_stay_on_one_node(two_nodes, token_client, sent_tasks, run) -> None:
    # dp=4 over both nodes, llama-124m (4 kv heads)
    wide = running_job(run, token_client, "wide", gpus=4, model="llama-124m")
    response = resize_job(run, token_client, wide, layout="tp=4")
    assert response.status_code == 409
    assert "ranks 0-3 run on nodes node-1, node-2" in response.json()["detail"]
    run(scheduling.job_stop, job_id=wide.pk)
    run(job_record_report, report=report_of(wide.pk, "stopped", "node-1"))

    one = running_job(run, token_client, "one", layout="dp=1")  # node-1/0
    scheduling.job_submit(name="blocker", model="tiny-gpt", layout="dp=1", global_batch=12)  # node-2/0
    scheduling.job_submit(name="blocker2", model="tiny-gpt", layout="dp=1", global_batch=12)  # node-1/1
    response = resize_job(run, token_client, one, layout="tp=2")  # rank 1 must join rank 0 on node-1
    assert response.status_code == 409
    assert "joining ranks 1 must run on node node-1 with ranks 0" in response.json()["detail"]


def test_a_start_never_takes_the_port_of_an_active_transition(two_nodes, token_client, sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=2")  # 29400
    assert resize_job(run, token_client, job, gpus=3).json()["rendezvous"] == "host-1:29401"
    other = scheduling.job_submit(name="other", model="tiny-gpt", layout="dp=1")
    assert other.rendezvous == "host-2:29402"


# --- reports --------------------------------------------------------------------------------

def test_duplicate_late_and_unknown_reports_are_ignored(two_nodes, token_client, sent_tasks, sent_events, run,
                                                        caplog) -> None:
    caplog.set_level(logging.INFO)
    job = running_job(run, token_client, layout="dp=2")
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])
    run(transition_report, treport(t, "transferring", step=3))
    run(transition_report, treport(t, "transferring", step=3))  # duplicate
    run(transition_report, treport(t, "ready", step=3, prepare_seconds=2.0))  # overtaken: fills its figure only
    t.refresh_from_db()
    assert (t.state, t.prepare_seconds) == ("transferring", 2.0)
    run(transition_report, _committed(t))
    sent_events.clear()
    for state in ("committed", "preparing", "transferring", "aborted", "rolled_back"):
        run(transition_report, treport(t, state, error="late"))
    t.refresh_from_db()
    job.refresh_from_db()
    assert (t.state, job.state, job.layout) == ("committed", "running", "dp=4")
    assert not sent_events  # nothing moved, nothing published
    assert "is already committed" in caplog.text

    assert run(transition_record_report, report=protocol.TransitionReport(
        job_id=job.pk, transition_id=99999, node="node-1", state="ready", sent_at=datetime.now(timezone.utc))) is None
    assert run(transition_record_report, report=protocol.TransitionReport(
        job_id=99999, transition_id=t.pk, node="node-1", state="ready", sent_at=datetime.now(timezone.utc))) is None
    assert "does not exist" in caplog.text
    run(transition_report, {"job_id": job.pk, "transition_id": t.pk, "node": "node-1", "state": "exploded"})
    assert "rejected transition report" in caplog.text


def _progress(done: int, rounds: int, **waves: list[int]) -> dict:
    return {"progress": protocol.TransferProgress(round=done, rounds=rounds, moved_bytes=100 * done,
                                                  waves={int(r[4:]): w for r, w in waves.items()})}


def test_transfer_progress_and_tensor_checks_are_stored_and_published(two_nodes, token_client, sent_tasks,
                                                                      sent_events, run) -> None:
    """Rank 0's live `transferring` reports (round k of R, its measured wave so far) and the
    committed report's every-rank waves and per-tensor checks: stored on the transition
    (the furthest round wins, whatever the arrival order), each change on the job's stream."""
    job = running_job(run, token_client, layout="dp=2")
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])
    before = job_live_snapshot(job_id=job.pk)
    sent_events.clear()
    run(transition_report, treport(t, "transferring", step=3, **_progress(1, 3, rank0=[10, 30, 20])))
    run(transition_report, treport(t, "transferring", step=3, **_progress(3, 3, rank0=[10, 30, 20, 25, 15, 18, 12])))
    run(transition_report, treport(t, "transferring", step=3, **_progress(2, 3, rank0=[10, 30, 20, 25, 15])))  # late
    t.refresh_from_db()
    assert t.state == "transferring"
    assert t.progress == {"round": 3, "rounds": 3, "moved_bytes": 300, "waves": {"0": [10, 30, 20, 25, 15, 18, 12]}}
    live = [e.transition.progress for e in sent_events if isinstance(e, TransitionEvent)]
    assert [(p.round, p.rounds) for p in live] == [(1, 3), (3, 3)]  # the late one changed nothing: not published
    tensors = [{"name": "embed", "shape": [64, 32], "match": True, "mismatched": [], "digest": "00ff"}]
    waves = {"rank0": [10, 30, 20, 25, 15, 18, 12], "rank3": [0, 5, 5, 9, 9, 9, 9]}
    run(transition_report, _committed(t, tensors=tensors, **_progress(2, 2, **waves)))
    t.refresh_from_db()
    assert t.state == "committed" and t.verification["tensors"] == tensors
    assert t.progress["waves"] == {"0": waves["rank0"], "3": waves["rank3"]} and t.progress["round"] == 3
    events = [e for e in sent_events if isinstance(e, TransitionEvent)]
    for event in events:
        job_event_adapter.validate_python(event.model_dump(mode="json"))
    assert events[-1].transition.progress.waves == {"0": tuple(waves["rank0"]), "3": tuple(waves["rank3"])}
    snapshot = before
    for event in events:
        snapshot = apply_job_event(snapshot, event)
    assert snapshot == job_live_snapshot(job_id=job.pk)
    page = token_client.get(f"/api/transitions/{t.pk}").json()
    assert page["verification"]["tensors"] == tensors


def test_a_digest_mismatch_rollback_keeps_the_failed_tensor_rows(two_nodes, token_client, sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=2")
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])
    run(transition_report, treport(t, "transferring", step=3))
    rows = [{"name": "embed", "shape": [64, 32], "match": True, "mismatched": [], "digest": "01"},
            {"name": "head", "shape": [32, 64], "match": False, "mismatched": ["exp_avg"], "digest": "02"}]
    run(transition_report, treport(t, "rolled_back", error="verification failed for 1 tensor states: head/exp_avg",
                                    tensors=rows))
    t.refresh_from_db()
    assert t.state == "rolled_back" and "head/exp_avg" in t.reason
    assert t.verification["verified"] is False and t.verification["tensors"] == rows


def test_the_ranks_abort_before_transferring(two_nodes, token_client, sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=2")
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])
    run(transition_report, treport(t, "preparing"))
    run(transition_report, treport(t, "aborted", error="joining rank 3 could not import torch"))
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted" and "joining rank 3 could not import torch" in t.reason
    assert (job.state, job.layout, job.world_size, len(job.placement)) == ("running", "dp=2", 2, 2)
    assert gpu_states() == {"node-1/0": ("allocated", "j"), "node-1/1": ("allocated", "j"),
                       "node-2/0": ("free", None), "node-2/1": ("free", None)}
    assert resize_job(run, token_client, job, gpus=3).status_code == 202  # a new resize may follow


def test_the_report_task_is_registered_with_the_control_worker() -> None:
    from controlplane.celery import app

    app.loader.import_default_modules()
    assert protocol.CONTROL_TRANSITION_REPORT in app.tasks


# --- failures during a transition -----------------------------------------------------------

def test_losing_a_joining_node_while_transferring_leaves_the_rollback_to_the_ranks(two_nodes, token_client,
                                                                                 sent_tasks, run) -> None:
    """The old ranks are alive and kept their state until the commit point: the switch
    fails on the ranks, which roll back and say so; the job is not failed meanwhile."""
    job = running_job(run, token_client, layout="dp=2")  # node-1
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])  # ranks 2, 3 on node-2
    run(transition_report, treport(t, "transferring"))
    sent_tasks.clear()
    later = dj_timezone.now() + timedelta(seconds=10)
    cluster.node_record_heartbeat(report=heartbeat("node-1", gpus=2, host="host-1"), received_at=later)
    assert run(node_loss.nodes_lost_sweep, silent_for=timedelta(seconds=6), now=later) == ["node-2"]
    t.refresh_from_db()
    job.refresh_from_db()
    assert (t.state, job.state) == ("transferring", "switching")
    assert not [name for name, _, _ in sent_tasks if name == protocol.NODE_JOB_STOP]
    run(transition_report, treport(t, "rolled_back", error="switch failed, back on dp=2: peer 2 closed"))
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "rolled_back" and "back on dp=2" in t.reason
    assert (job.state, job.layout, job.world_size, job.error) == ("running", "dp=2", 2, "")
    gpus = gpu_states()
    assert (gpus["node-1/0"], gpus["node-1/1"]) == (("allocated", "j"), ("allocated", "j"))
    assert gpus["node-2/0"] == ("lost", None) and gpus["node-2/1"] == ("lost", None)
    run(transition_report, _committed(t))  # late: the transition is over
    t.refresh_from_db()
    assert t.state == "rolled_back" and t.verification == {}


def test_losing_a_node_of_the_old_ranks_while_transferring_aborts_and_fails_the_job(two_nodes, token_client,
                                                                                  sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=2")  # node-1
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])  # ranks 2, 3 on node-2
    run(transition_report, treport(t, "transferring"))
    sent_tasks.clear()
    later = dj_timezone.now() + timedelta(seconds=10)
    cluster.node_record_heartbeat(report=heartbeat("node-2", gpus=2, host="host-2"), received_at=later)
    assert run(node_loss.nodes_lost_sweep, silent_for=timedelta(seconds=6), now=later) == ["node-1"]
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted"
    assert "the job failed while the transition was transferring" in t.reason
    assert job.state == "failed" and "node node-1 (ranks 0, 1) lost" in job.error
    gpus = gpu_states()
    assert (gpus["node-2/0"], gpus["node-2/1"], gpus["node-1/0"]) == (("free", None), ("free", None), ("lost", None))
    assert {q for name, _, q in sent_tasks if name == protocol.NODE_JOB_STOP} == {"node.node-1", "node.node-2"}


def test_a_failed_rank_while_preparing_aborts_and_stops_the_joining_node(two_nodes, token_client, sent_tasks,
                                                                       run) -> None:
    job = running_job(run, token_client, layout="dp=2")
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])
    run(transition_report, treport(t, "preparing"))
    sent_tasks.clear()
    run(job_record_report, report=protocol.job_report(job_id=job.pk, node="node-1", kind="failed", ranks=(1,),
                                                     error="rank 1 exited with code 1",
                                                     sent_at=datetime.now(timezone.utc)))
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted" and "the job failed while the transition was preparing" in t.reason
    assert job.state == "failed"
    assert {state for state, _ in gpu_states().values()} == {"free"}
    assert [(name, q) for name, _, q in sent_tasks] == [(protocol.NODE_JOB_STOP, "node.node-2")]


def test_a_stop_during_a_transition_reaches_the_joining_node(two_nodes, token_client, sent_tasks, run) -> None:
    job = running_job(run, token_client, layout="dp=2")
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])
    sent_tasks.clear()
    assert run(token_client.post, f"/api/jobs/{job.pk}/stop").json()["state"] == "stopping"
    assert {q for name, _, q in sent_tasks if name == protocol.NODE_JOB_STOP} == {"node.node-1", "node.node-2"}
    run(job_record_report, report=report_of(job.pk, "stopped", "node-1"))
    t.refresh_from_db()
    assert t.state == "aborted" and "the job stopped while the transition was planned" in t.reason
    assert {state for state, _ in gpu_states().values()} == {"free"}


def test_a_refused_switch_order_aborts_the_resize_and_the_job_trains_on(two_nodes, token_client, run,
                                                                       monkeypatch) -> None:
    """Issue 43: the broker refuses the second node's switch order (an outage): the resize ends
    aborted saying so, the job is running in its layout on its GPUs, the joining GPUs are free,
    and the node that got its order is told to drop the switch."""
    from kombu.exceptions import OperationalError

    from controlplane.celery import app

    job = running_job(run, token_client, layout="dp=2")
    sent = []

    def refuse(name, args=None, queue=None, **kwargs):
        if name == protocol.NODE_JOB_SWITCH and sent:
            raise OperationalError("broker down")
        sent.append((name, queue))

    monkeypatch.setattr(app, "send_task", refuse)
    assert resize_job(run, token_client, job, gpus=4).status_code == 202
    job.refresh_from_db()
    row = Transition.objects.get(job=job)
    assert (job.state, job.layout, job.error) == ("running", "dp=2", "")
    assert row.state == "aborted" and "could not be sent (broker down); the job trains on in dp=2" in row.reason
    assert sum(state == ("allocated", job.name) for state in gpu_states().values()) == 2
    told = sent[0][1]
    assert (protocol.NODE_JOB_SWITCH_CANCEL, told) in sent


# --- schema ---------------------------------------------------------------------------------

def test_schema_has_resize_and_generates_without_warnings(tmp_path) -> None:
    from rest_framework.test import APIClient

    schema = APIClient().get("/api/schema/", HTTP_ACCEPT="application/vnd.oai.openapi+json").json()
    resize = schema["paths"]["/api/jobs/{id}/resize"]["post"]
    assert resize["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/JobResize")
    assert "202" in resize["responses"]
    assert "job" in [p["name"] for p in schema["paths"]["/api/transitions"]["get"]["parameters"]]
    call_command("spectacular", "--fail-on-warn", "--file", str(tmp_path / "schema.yaml"))


def test_losing_a_node_with_only_joining_ranks_before_the_transfer_aborts_the_resize_not_the_job(
        two_nodes, token_client, sent_tasks, sent_events, run) -> None:
    """The job's ranks never left their layout: the resize is aborted with the reason, the
    job trains on (rank 0 abandons the switch when the joining ranks never come)."""
    job = running_job(run, token_client, layout="dp=2")  # node-1
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])  # ranks 2, 3 on node-2
    run(transition_report, treport(t, "preparing"))
    sent_tasks.clear()
    later = dj_timezone.now() + timedelta(seconds=10)
    cluster.node_record_heartbeat(report=heartbeat("node-1", gpus=2, host="host-1"), received_at=later)
    assert run(node_loss.nodes_lost_sweep, silent_for=timedelta(seconds=6), now=later) == ["node-2"]
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted" and "node node-2 (joining ranks 2, 3) lost before the transfer" in t.reason
    assert [h["state"] for h in t.history][-1] == "aborted"
    assert (job.state, job.layout, job.world_size, job.error) == ("running", "dp=2", 2, "")
    gpus = gpu_states()
    assert (gpus["node-1/0"], gpus["node-1/1"]) == (("allocated", "j"), ("allocated", "j"))
    assert gpus["node-2/0"][1] is None and gpus["node-2/1"][1] is None  # no longer the job's
    assert not [name for name, _, _ in sent_tasks if name == protocol.NODE_JOB_STOP]
    cancels = [(args, q) for name, args, q in sent_tasks if name == protocol.NODE_JOB_SWITCH_CANCEL]
    assert [q for _, q in cancels] == ["node.node-1"]  # rank 0's node is told to drop the switch
    cancel = protocol.JobSwitchCancel.model_validate(cancels[0][0])
    assert (cancel.job_id, cancel.transition_id) == (job.pk, t.pk) and "lost before the transfer" in cancel.reason
    run(transition_report, treport(t, "aborted", error="switch abandoned: 0 of 2 joining ranks ready"))
    t.refresh_from_db()
    assert t.state == "aborted"  # rank 0's own abort, late, changes nothing
