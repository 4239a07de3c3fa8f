"""Ranks lost while training, control-plane half of the survivors path (issue 6): ranks
that outlived their world report `orphaned`; once the dead node is marked lost, the restore
task switches the job onto them without a checkpoint (recovery order, renumbered ranks, a
`restore` row that says so, committed by rank 0's report with the engine's figures), or,
when they may not take over, restores from the checkpoint or fails, saying why.

Real database and Redis; only the control plane's Celery send_task is replaced, by a
recorder, since no agent runs here.
"""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from agents import protocol
from controlplane.jobs import restore
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.reports import job_record_report, transition_record_report
from tests.controlplane.test_jobs_restore import gpu_states, started_job, lose_node, make_report, sent_of, trained_to

pytestmark = pytest.mark.django_db


def _orphaned(run, job: Job, node: str, ranks: tuple[int, ...], step: int) -> None:
    run(job_record_report, report=make_report(job, "orphaned", node=node, ranks=ranks, step=step,
                                          error="RuntimeError: Connection closed by peer"))


def _committed(row: Transition, **fields) -> protocol.TransitionReport:
    return protocol.TransitionReport(job_id=row.job_id, transition_id=row.pk, node="node-2", state="committed",
                                     sent_at=datetime.now(timezone.utc), **fields)


def test_rank_0s_node_lost_the_survivors_are_renumbered_and_go_on_without_a_checkpoint(
        two_nodes, token_client, sent_tasks, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)  # dp=4: ranks 0, 1 on node-1; 2, 3 on node-2
    old_port = job.rendezvous_port
    trained_to(run, job, 14, None)
    sent_tasks.clear()
    _orphaned(run, job, "node-2", (2,), 14)
    job.refresh_from_db()
    assert job.state == "restoring"
    assert job.error == ("node node-2 ranks 2 lost their peers (RuntimeError: Connection closed by peer); recovering "
                         "on the surviving ranks if they outlived their world (no checkpoint)")
    # A first look soon (the survivors need not wait for the sweep), and the final decision.
    assert [q for _, q in sent_of(sent_tasks, protocol.CONTROL_JOB_RESTORE)] == [protocol.CONTROL_FLOWS_QUEUE] * 2
    _orphaned(run, job, "node-2", (3,), 14)
    _orphaned(run, job, "node-2", (3,), 14)  # a duplicate changes nothing
    sent_tasks.clear()
    row = run(restore.job_restore, job_id=job.pk, early=True)  # node-1 is not marked lost yet
    assert run(restore.job_restore, job_id=job.pk) is None  # the final look finds it done
    assert lose_node(run, "node-1", keep="node-2") == ["node-1"]  # (the job holds nothing there any more)
    job.refresh_from_db()
    assert (job.state, job.layout, job.world_size, job.error, job.recovery) == ("starting", "dp=2", 2, "", {})
    assert job.placement == [{"rank": 0, "node": "node-2", "gpu": 0}, {"rank": 1, "node": "node-2", "gpu": 1}]
    assert job.rendezvous_port != old_port and job.rendezvous == f"host-2:{job.rendezvous_port}"
    assert job.restore_id == row.pk
    assert (row.kind, row.state, row.source_layout, row.destination_layout, row.step) == (
        "restore", "planned", "dp=4", "dp=2", 14)
    assert row.reason == ("node node-2 ranks 2 lost their peers (RuntimeError: Connection closed by peer) at step 14; "
                          "switched on the survivors without a checkpoint (no step redone): ranks 2->0, 3->1 held "
                          "dp=2, switched to dp=2 on 2 GPUs")
    # source_restore: the world the survivors come from (the first: no restore), whose late
    # step reports up to step 14 are still the job's (reports.refusal)
    assert row.verification["survivors"] == {"ranks": [[2, 0], [3, 1]], "source_layout": "dp=2", "step": 14,
                                             "source_restore": None}
    assert row.plan_fingerprint and row.plan_summary["network_bytes"] == 0  # the replicas stay where they are
    ((message, queue),) = sent_of(sent_tasks, protocol.NODE_JOB_RECOVER)
    order = protocol.JobRecoverOrder.model_validate(message)
    assert queue == "node.node-2"
    assert (order.restore_id, order.step, order.src_layout, order.src_world, order.layout, order.world,
            order.union_world, order.rendezvous) == (row.pk, 14, "dp=2", 2, "dp=2", 2, 2, job.rendezvous)
    assert [(m.old, m.new) for m in order.ranks] == [(2, 0), (3, 1)]
    assert not sent_of(sent_tasks, protocol.NODE_JOB_START)
    gpus = gpu_states()
    assert (gpus["node-2/0"], gpus["node-2/1"], gpus["node-1/0"]) == (("allocated", "j"), ("allocated", "j"),
                                                                      ("lost", None))
    # Reports of the old world are ignored; rank 0's `committed` commits the row with the engine's figures.
    run(job_record_report, report=make_report(job, "step", step=15, loss=2.0))
    run(transition_record_report, report=_committed(row, step=14, transfer_seconds=0.02, verify_seconds=0.01,
                                                    pause_seconds=3.5, network_bytes=0, rounds=1, verified=True,
                                                    fingerprint=row.plan_fingerprint))
    run(job_record_report, report=make_report(job, "started", node="node-2", step=15, restore_id=row.pk))
    row.refresh_from_db()
    job.refresh_from_db()
    assert (row.state, row.transfer_seconds, row.verify_seconds, row.pause_seconds) == ("committed", 0.02, 0.01, 3.5)
    assert (row.verification["verified"], row.verification["matches_plan"]) == (True, True)
    assert row.verification["survivors"]["source_layout"] == "dp=2"
    assert [h["state"] for h in row.history] == ["planned", "committed"]
    assert (job.state, job.step) == ("running", 14)
    listed = token_client.get(f"/api/transitions?job={job.pk}").json()["results"]
    assert [(t["kind"], t["state"]) for t in listed] == [("restore", "committed")]


def test_survivors_a_step_apart_go_on_at_the_latest_step_the_rank_behind_joining_empty_handed(
        two_nodes, token_client, sent_tasks, run) -> None:
    """Rank 2 completed the broken step 14's all-reduce and applied it, rank 3 did not (gloo's
    ring can finish on some ranks): rank 2's replica is the state, rank 3 joins without one."""
    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)
    trained_to(run, job, 14, None)
    _orphaned(run, job, "node-2", (2,), 14)
    _orphaned(run, job, "node-2", (3,), 13)
    sent_tasks.clear()
    row = run(restore.job_restore, job_id=job.pk, early=True)
    assert (row.kind, row.step, row.source_layout, row.destination_layout) == ("restore", 14, "dp=4", "dp=2")
    assert row.verification["survivors"]["ranks"] == [[2, 0], [3, 1]]
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_RECOVER)
    order = protocol.JobRecoverOrder.model_validate(message)
    assert (order.step, order.src_world, order.world) == (14, 1, 2)


def test_survivors_that_cannot_take_over_leave_the_checkpoint_or_a_failure_saying_why(
        two_nodes, token_client, sent_tasks, run) -> None:
    # Different steps: rank 0 finished the broken step, rank 1 (the other half of its tp=2 replica) did not.
    skew = started_job(run, token_client, "skew", layout="tp=2,dp=2", checkpoint_interval=10)
    trained_to(run, skew, 12, 10)
    _orphaned(run, skew, "node-1", (0,), 12)
    _orphaned(run, skew, "node-1", (1,), 11)
    run(job_record_report, report=make_report(skew, "failed", node="node-2", ranks=(2,), error="killed"))
    assert run(restore.job_restore, job_id=skew.pk, early=True) is None  # the first look leaves it to the last
    assert Job.objects.get(pk=skew.pk).state == "restoring"
    row = run(restore.job_restore, job_id=skew.pk)
    assert row.reason.startswith("node node-1 ranks 0 lost their peers")
    assert "restored from checkpoint step 10" in row.reason
    assert row.reason.endswith("not switched on them: the surviving ranks stopped at different steps [11, 12], and "
                               "those at step 12 (ranks [0]) no longer held every state element")


def test_the_waiting_ranks_of_a_node_whose_agent_reported_a_failure_are_not_survivors(
        two_nodes, token_client, sent_tasks, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)
    trained_to(run, job, 9, None)
    _orphaned(run, job, "node-2", (2, 3), 9)
    # node-2's agent then reports one of them dead: it kills the job's ranks there.
    run(job_record_report, report=make_report(job, "failed", node="node-2", ranks=(3,), error="exited with code 1"))
    job.refresh_from_db()
    assert job.recovery["failed_nodes"] == ["node-2"]
    run(job_record_report, report=make_report(job, "orphaned", node="node-1", ranks=(0, 1), step=9))
    row = run(restore.job_restore, job_id=job.pk)
    assert row.verification["survivors"]["ranks"] == [[0, 0], [1, 1]]


def test_zero_1_survivors_miss_optimizer_states_so_a_node_loss_without_a_checkpoint_fails_at_once(
        two_nodes, token_client, sent_tasks, run) -> None:
    zero = started_job(run, token_client, "zero", layout="dp=4,zero=1", checkpoint_interval=0)
    trained_to(run, zero, 3, None)
    lose_node(run, "node-2", keep="node-1")
    zero.refresh_from_db()
    assert zero.state == "failed"
    assert zero.error.endswith("; no checkpoint to restore from (checkpoint_interval=0: checkpoints are off)")


def test_no_survivors_at_all_and_no_checkpoint_fails_and_a_broken_recovery_does_not_loop(
        two_nodes, token_client, sent_tasks, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)
    trained_to(run, job, 5, None)
    sent_tasks.clear()
    lose_node(run, "node-2", keep="node-1")  # no rank reported waiting before the node counted as lost
    job.refresh_from_db()
    # node-2 went silent (a cut link?): node-1's ranks would learn it when their step times out.
    assert job.state == "restoring"
    assert [q for _, q in sent_of(sent_tasks, protocol.CONTROL_JOB_RESTORE)] == [protocol.CONTROL_FLOWS_QUEUE] * 2
    run(restore.job_restore, job_id=job.pk)  # ... they never report: the final look
    job.refresh_from_db()
    assert job.state == "failed" and job.error == (
        "node node-2 (ranks 2, 3) lost; no checkpoint to restore from (checkpoint_interval=0: checkpoints are off); "
        "the survivors could not take over: no surviving rank outlived its world (none reported waiting for a "
        "recovery order)")
    assert {state for state, _ in gpu_states().values()} == {"free", "lost"}
    # A rank that died on a live node: the others may have outlived it; none reports here.
    crash = started_job(run, token_client, "crash", gpus=2, checkpoint_interval=0)  # node-1, dp=2
    trained_to(run, crash, 3, None)
    run(job_record_report, report=make_report(crash, "failed", node="node-1", ranks=(1,), error="rank 1: MemoryError"))
    crash.refresh_from_db()
    assert crash.state == "failed"  # node-1's agent killed rank 0 too: nobody can take over
    assert crash.error == "node node-1 ranks 1: rank 1: MemoryError"
    # A survivors' world that fails before it commits (e.g. its replicas disagree) is not recovered again.
    again = started_job(run, token_client, "again", gpus=2, checkpoint_interval=0)  # node-1, dp=2
    trained_to(run, again, 4, None)
    _orphaned(run, again, "node-1", (1,), 4)
    run(job_record_report, report=make_report(again, "failed", node="node-1", ranks=(0,), error="boom"))
    again.refresh_from_db()
    assert again.state == "restoring"
    assert run(restore.job_restore, job_id=again.pk) is None  # node-1 reported a failure: nobody survives
    again.refresh_from_db()
    assert again.state == "failed"


def test_a_failed_recovered_world_ends_its_restore_row_and_fails_without_a_checkpoint(
        two_nodes, token_client, sent_tasks, run) -> None:
    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)
    trained_to(run, job, 7, None)
    _orphaned(run, job, "node-1", (0, 1), 7)
    lose_node(run, "node-2", keep="node-1")
    row = run(restore.job_restore, job_id=job.pk)
    assert row.destination_layout == "dp=2"
    run(job_record_report, report=make_report(job, "failed", node="node-1", ranks=(1,), restore_id=row.pk,
                                          error="the survivors disagree: step 7 on rank 0, 6 on rank 1"))
    job.refresh_from_db()
    row.refresh_from_db()
    assert job.state == "failed" and "the survivors disagree" in job.error
    assert row.state == "aborted"


def test_the_transition_page_says_the_survivors_took_over(two_nodes, token_client, sent_tasks, run, user) -> None:
    from django.test import Client

    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)
    trained_to(run, job, 6, None)
    _orphaned(run, job, "node-2", (2, 3), 6)
    lose_node(run, "node-1", keep="node-2")
    row = run(restore.job_restore, job_id=job.pk)
    browser = Client()
    browser.force_login(user)
    html = browser.get(f"/transitions/{row.pk}/").content.decode()
    assert 'id="no-plan"' in html and "loaded the checkpoint" not in html
    assert "Switched on the survivors without a checkpoint" in html and "2&rarr;0, 3&rarr;1" in html
    assert f"plan {row.plan_fingerprint[:12]}" in html


def test_the_survivors_of_a_pipeline_job_switch_under_the_device_map(token_client, sent_tasks, run) -> None:
    """pp=2,dp=3 on three nodes (stage 0: ranks 0-2, stage 1: ranks 3-5; two per node);
    node-3 (ranks 4, 5) lost. The whole replica (0, 3) becomes processes 0, 1 (pp=2), the
    others 2, 3 join it: pp=2,dp=2. In the survivors' order process 1 (stage 1) would take
    rank 1 (stage 0) and process 2 (stage 0) rank 2 (stage 1); the device map swaps them,
    so every survivor keeps its stage and far fewer bytes move."""
    from controlplane.cluster import services as cluster
    from tests.controlplane.conftest import heartbeat

    for i in (1, 2, 3):
        cluster.node_record_heartbeat(report=heartbeat(f"node-{i}", gpus=2, host=f"host-{i}"))
    job = started_job(run, token_client, layout="pp=2,dp=3", checkpoint_interval=0)
    assert [(s["rank"], s["node"]) for s in job.placement] == [
        (0, "node-1"), (1, "node-1"), (2, "node-2"), (3, "node-2"), (4, "node-3"), (5, "node-3")]
    trained_to(run, job, 9, None)
    _orphaned(run, job, "node-1", (0, 1), 9)
    _orphaned(run, job, "node-2", (2, 3), 9)
    sent_tasks.clear()
    row = run(restore.job_restore, job_id=job.pk, early=True)
    assert isinstance(row, Transition), row
    job.refresh_from_db()
    assert (row.source_layout, row.destination_layout, job.layout) == ("pp=2,dp=3", "pp=2,dp=2", "pp=2,dp=2")
    assert row.verification["survivors"]["ranks"] == [[0, 0], [3, 1], [1, 2], [2, 3]]
    assert row.process_of == [0, 2, 1, 3]
    assert row.plan_summary["network_bytes"] < row.plan_summary["contract_order_network_bytes"]
    # Rank d runs where process process_of[d] (old rank 0, 1, 3, 2 for ranks 0..3) ran.
    assert job.placement == row.destination_placement == [
        {"rank": 0, "node": "node-1", "gpu": 0}, {"rank": 1, "node": "node-1", "gpu": 1},
        {"rank": 2, "node": "node-2", "gpu": 1}, {"rank": 3, "node": "node-2", "gpu": 0}]
    orders = {queue: protocol.JobRecoverOrder.model_validate(m) for m, queue in
              sent_of(sent_tasks, protocol.NODE_JOB_RECOVER)}
    assert set(orders) == {"node.node-1", "node.node-2"}
    assert {order.process_of for order in orders.values()} == {(0, 2, 1, 3)}
    assert [orders["node.node-1"].rank_of(p) for p in range(4)] == [0, 2, 1, 3]


def test_the_first_look_waits_for_a_rank_whose_neighbour_reported(two_nodes, token_client, sent_tasks, run) -> None:
    """CI, session 24: node-1's rank 0 reported waiting, its rank 1 had not yet when the first
    look came (a busy host), and the job went on on rank 0 alone (dp=1), leaving a live rank
    and its GPU out. The first look now leaves such a job to the final one."""
    job = started_job(run, token_client, gpus=4, checkpoint_interval=0)  # dp=4: ranks 0, 1 on node-1; 2, 3 on node-2
    trained_to(run, job, 14, None)
    _orphaned(run, job, "node-1", (0,), 14)
    assert restore.unreported_beside(job.placement, {0: 14}, {("node-1", 0), ("node-1", 1), ("node-2", 0)}) == [1]
    assert run(restore.job_restore, job_id=job.pk, early=True) is None
    job.refresh_from_db()
    assert (job.state, job.world_size) == ("restoring", 4)
    _orphaned(run, job, "node-1", (1,), 14)  # it reports before the final look
    assert lose_node(run, "node-2", keep="node-1") == ["node-2"]
    row = run(restore.job_restore, job_id=job.pk)
    job.refresh_from_db()
    assert (row.kind, row.destination_layout, job.layout, job.world_size) == ("restore", "dp=2", "dp=2", 2)
    assert [(s["node"], s["rank"]) for s in job.placement] == [("node-1", 0), ("node-1", 1)]


def test_unreported_beside_is_the_silent_ranks_of_reporting_nodes_only() -> None:
    placement = [{"rank": r, "node": f"node-{1 + r // 2}", "gpu": r % 2} for r in range(6)]
    alive = {(f"node-{n}", g) for n in (1, 2, 3) for g in (0, 1)}
    assert restore.unreported_beside(placement, {}, alive) == []
    assert restore.unreported_beside(placement, {0: 5, 1: 5}, alive) == []
    assert restore.unreported_beside(placement, {0: 5, 3: 5}, alive) == [1, 2]
    assert restore.unreported_beside(placement, {0: 5, 3: 5}, alive - {("node-1", 1)}) == [2]  # its GPU is gone
