"""Ranks that outlive their world, agent half (issue 6): real rank processes in a real gloo
world on two job runners (two "nodes"), real Redis. Rank 0's process dies; rank 1 keeps
its state and waits, its agent reports it `orphaned`; a JobRecoverOrder makes it rank 0 of
a one-rank world that switches the state on (digests verified) and trains on from the next
step, reporting under the new restore id. Without an order it gives up after the job's
timeout and its agent reports the failure; a stop order ends the wait quietly."""
from __future__ import annotations

import os
import signal

import pytest

from agents import protocol
from parallelism.layout.spec import parse_layout
from agents.node.jobs import JobRunner
from tests.agents.node.test_job_runner import (free_loopback_port, reports_of_job, broker_messages, start_order, wait_until,  # noqa: F401
                                               broker)

pytestmark = pytest.mark.timeout(240)


def _two_nodes(url, tmp_path, job_id: int, timeout: float = 60, env: dict | None = None):
    """Runners node-1 (rank 0) and node-2 (rank 1) of a dp=2 job, and what each agent
    reported; `env`: {node: environment} for its ranks."""
    reports: dict[str, list] = {"node-1": [], "node-2": []}
    runners = [JobRunner(reports[f"node-{i}"].append, f"node-{i}", "cpu", url, tmp_path / f"node-{i}",
                         env=(env or {}).get(f"node-{i}")) for i in (1, 2)]
    port = free_loopback_port()
    for runner, rank in zip(runners, (0, 1)):
        runner.start(start_order(job_id, 2, [rank], port).model_copy(update={"timeout_seconds": timeout}))
    return runners, reports


def _lose_rank_0(client, runners, reports, job_id: int) -> dict:
    wait_until(lambda: len([r for r in reports_of_job(client, job_id) if r["kind"] == "step"]) >= 3, 120, "three steps")
    os.kill(runners[0].jobs[job_id].ranks[0].process.pid, signal.SIGKILL)
    (orphaned,) = wait_until(lambda: [r for r in reports["node-2"] if r.kind == "orphaned"], 60, "the orphaned report")
    assert orphaned.ranks == (1,) and orphaned.restore_id is None
    assert "Connection closed by peer" in orphaned.error or "Connection reset by peer" in orphaned.error
    assert runners[1].running() == {job_id: [1]}  # rank 1 waits, with its state
    return orphaned


def test_the_survivor_becomes_rank_0_of_a_new_world_and_trains_on_from_its_memory(broker, tmp_path):
    url, client = broker
    runners, reports = _two_nodes(url, tmp_path, 21)
    try:
        orphaned = _lose_rank_0(client, runners, reports, 21)
        last = max(r["step"] for r in reports_of_job(client, 21) if r["kind"] == "step")
        # rank 0's step reports wait in its batcher for up to one window (0.5 s): the survivor
        # may be steps past the last one that left, never behind it
        assert orphaned.step >= last
        client.delete(protocol.CONTROL_QUEUE)
        port = free_loopback_port()
        runners[1].recover(protocol.JobRecoverOrder(
            job_id=21, restore_id=5, step=orphaned.step, rendezvous=f"127.0.0.1:{port}", src_layout="dp=1",
            src_world=1, layout="dp=1", world=1, union_world=1, ranks=(protocol.RankMove(old=1, new=0),)))
        wait_until(lambda: len([r for r in reports_of_job(client, 21) if r["kind"] == "step"]) >= 2, 120,
              "steps in the survivors' world")
        reports_after = reports_of_job(client, 21)
        assert reports_after[0]["kind"] == "started" and reports_after[0]["restore_id"] == 5
        steps = [r for r in reports_after if r["kind"] == "step"]
        assert [r["step"] for r in steps[:2]] == [orphaned.step + 1, orphaned.step + 2]
        assert all(r["restore_id"] == 5 and r["layout"] == str(parse_layout("dp=1")) and 0 < r["loss"] < 20 for r in steps)
        (committed,) = [protocol.TransitionReport.model_validate(m) for m in
                        broker_messages(client, protocol.CONTROL_TRANSITION_REPORT, 21)]
        assert (committed.transition_id, committed.state, committed.verified, committed.step) == (
            5, "committed", True, orphaned.step)
        assert committed.tensors and all(check.match for check in committed.tensors)
        assert committed.network_bytes == 0 and committed.pause_seconds > committed.transfer_seconds > 0
        assert runners[1].running() == {21: [0]}
        runners[1].stop(protocol.JobStopOrder(job_id=21))
        wait_until(lambda: not runners[1].running(), 60, "the survivor to stop")
        assert reports_of_job(client, 21)[-1]["kind"] == "stopped"
        assert [r.kind for r in reports["node-2"]] == ["orphaned"]  # nothing failed on node-2
        print(f"survivor switched on in {committed.pause_seconds:.2f} s from the loss to its first step "
              f"(transfer {committed.transfer_seconds:.3f} s, verify {committed.verify_seconds:.3f} s)")
    finally:
        for runner in runners:
            runner.shutdown()


def test_a_peer_lost_in_the_loss_sum_leaves_its_step_trained_and_reported_without_a_loss(broker, tmp_path):
    """Rank 1 dies once step 3's update is done, before the all-reduce that sums its loss
    (the state moved on with the step, orphan.py point 1). Rank 0 fails in that all-reduce:
    it reports step 3 with its loss unknown and waits, orphaned after step 3. The control
    plane's record of trained steps (CI once saw it skip the step) has no hole."""
    url, client = broker
    runners, reports = _two_nodes(url, tmp_path, 26, env={"node-2": {"DYNAPLANE_FAULT": "exit-before-loss-sum:1:3"}})
    try:
        (orphaned,) = wait_until(lambda: [r for r in reports["node-1"] if r.kind == "orphaned"], 90,
                                 "the orphaned report")
        assert orphaned.ranks == (0,) and orphaned.step == 3
        steps = wait_until(lambda: (s := [r for r in reports_of_job(client, 26) if r["kind"] == "step"])
                           and s[-1]["step"] == 3 and s, 30, "step 3's report")
        assert [r["step"] for r in steps] == [1, 2, 3]
        assert all(0 < r["loss"] < 20 for r in steps[:2]) and steps[2]["loss"] is None
        assert steps[2]["step_seconds"] > 0 and steps[2]["tokens_per_second"] > 0
        assert runners[0].running() == {26: [0]}  # rank 0 waits, with its state
    finally:
        for runner in runners:
            runner.shutdown()


def test_without_an_order_the_survivor_gives_up_after_the_timeout_and_a_stop_ends_the_wait(broker, tmp_path):
    url, client = broker
    runners, reports = _two_nodes(url, tmp_path, 22, timeout=8)
    try:
        _lose_rank_0(client, runners, reports, 22)
        (failed,) = wait_until(lambda: [r for r in reports["node-2"] if r.kind == "failed"], 60, "the failure report")
        assert failed.ranks == (1,) and "no recovery order came within 8 s" in failed.error
    finally:
        for runner in runners:
            runner.shutdown()
    client.delete(protocol.CONTROL_QUEUE)
    runners, reports = _two_nodes(url, tmp_path / "again", 23)
    try:
        _lose_rank_0(client, runners, reports, 23)
        runners[1].stop(protocol.JobStopOrder(job_id=23))
        wait_until(lambda: not runners[1].running(), 30, "the waiting rank to leave")
        assert [r.kind for r in reports["node-2"]] == ["orphaned"]  # it left quietly
    finally:
        for runner in runners:
            runner.shutdown()


def test_only_a_lost_peers_errors_are_survived_and_the_survivors_must_agree() -> None:
    import torch.distributed as dist

    from agents.runtime.orphan import agreement, peer_lost, reporter_behind

    assert peer_lost(RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                                  "by peer [127.0.0.1]:3740"))
    assert peer_lost(dist.DistNetworkError("store gone"))
    assert not peer_lost(RuntimeError("CUDA out of memory")) and not peer_lost(ValueError("gloo/transport/"))
    box = (0, "param", (0, 4, 0, 1))
    same = [(9, 36, {box: 7}), (9, 36, {box: 7}), (9, 36, {})]
    assert agreement(same, 9, 2) is None
    assert agreement(same, 8, 2) == ("the survivors holding the state stopped at steps {0: 9, 1: 9} (new rank: step), "
                                     "the order says 8")
    # A rank that stopped a step behind (its broken all-reduce never completed) joins empty-handed.
    assert agreement([(9, 36, {box: 7}), (9, 36, {box: 7}), (8, 32, {})], 9, 2) is None
    assert agreement([(9, 36, {box: 7}), (8, 32, {box: 7})], 9, 2).startswith("the survivors holding the state stopped")
    assert agreement([(9, 36, {box: 7}), (9, 40, {box: 7})], 9, 2).startswith("the survivors' data positions differ")
    assert agreement([(9, 36, {box: 7}), (9, 36, {box: 8})], 9, 2) == (
        "replicas differ: tensor 0 param box (0, 4, 0, 1) on new ranks 0 and 1")
    assert agreement([(9, 36, {box: 7}), (9, 36, {box: 8})], 9, 1) is None  # rank 1 brings no state
    # The old rank 0 (the job's reporter) a step behind: the new rank 0 reports the step it missed.
    assert reporter_behind([(1, 9), (2, 9), (0, 8)], 9)
    assert not reporter_behind([(1, 9), (0, 9)], 9) and not reporter_behind([(1, 9), (2, 8)], 9)


def test_a_recovery_order_names_each_rank_once_inside_its_world() -> None:
    fields = dict(job_id=1, restore_id=2, step=3, rendezvous="h:1", src_layout="dp=1", src_world=1, layout="dp=1",
                  world=1, union_world=2)
    protocol.JobRecoverOrder(**fields, ranks=(protocol.RankMove(old=3, new=0), protocol.RankMove(old=1, new=1)))
    with pytest.raises(ValueError, match="a rank appears twice"):
        protocol.JobRecoverOrder(**fields, ranks=(protocol.RankMove(old=3, new=0), protocol.RankMove(old=3, new=1)))
    with pytest.raises(ValueError, match="outside the union world of 2 ranks"):
        protocol.JobRecoverOrder(**fields, ranks=(protocol.RankMove(old=3, new=2),))


def test_a_tensor_parallel_replica_survives_renumbered(broker, tmp_path):
    """tp=2,dp=2: node-1 runs replica 0 (ranks 0, 1), node-2 replica 1 (ranks 2, 3). node-1's
    ranks die; ranks 2, 3 become ranks 0, 1 of tp=2 (each keeps its TP half) and train on."""
    url, client = broker
    reports: dict[str, list] = {"node-1": [], "node-2": []}
    runners = [JobRunner(reports[f"node-{i}"].append, f"node-{i}", "cpu", url, tmp_path / f"node-{i}")
               for i in (1, 2)]
    port = free_loopback_port()
    try:
        for runner, ranks in zip(runners, ([0, 1], [2, 3])):
            runner.start(start_order(24, 4, ranks, port, layout="tp=2,dp=2"))
        wait_until(lambda: len([r for r in reports_of_job(client, 24) if r["kind"] == "step"]) >= 2, 180, "two steps")
        for rank in (0, 1):
            os.kill(runners[0].jobs[24].ranks[rank].process.pid, signal.SIGKILL)
        orphaned = wait_until(lambda: (o := [r for r in reports["node-2"] if r.kind == "orphaned"])
                         and sorted(x for r in o for x in r.ranks) == [2, 3] and o, 60, "both orphaned")
        (step,) = {r.step for r in orphaned}
        client.delete(protocol.CONTROL_QUEUE)
        runners[1].recover(protocol.JobRecoverOrder(
            job_id=24, restore_id=6, step=step, rendezvous=f"127.0.0.1:{free_loopback_port()}", src_layout="tp=2",
            src_world=2, layout="tp=2", world=2, union_world=2,
            ranks=(protocol.RankMove(old=2, new=0), protocol.RankMove(old=3, new=1))))
        wait_until(lambda: len([r for r in reports_of_job(client, 24) if r["kind"] == "step"]) >= 2, 180,
              "steps in the survivors' world")
        steps = [r for r in reports_of_job(client, 24) if r["kind"] == "step"]
        assert [r["step"] for r in steps[:2]] == [step + 1, step + 2] and all(r["restore_id"] == 6 for r in steps)
        (committed,) = [protocol.TransitionReport.model_validate(m) for m in
                        broker_messages(client, protocol.CONTROL_TRANSITION_REPORT, 24)]
        assert committed.verified is True and all(check.match for check in committed.tensors)
        assert runners[1].running() == {24: [0, 1]}
        assert [r.kind for r in reports["node-2"]] == ["orphaned"] * len(orphaned)
    finally:
        for runner in runners:
            runner.shutdown()


@pytest.mark.timeout(300)
def test_survivors_switch_under_a_device_map_and_their_agents_renumber_them(broker, tmp_path):
    """pp=2,dp=3 on three nodes (stage 0: ranks 0-2, stage 1: ranks 3-5); node-3's ranks 4,
    5 die. The whole replica (0, 3) becomes processes 0, 1 (pp=2), ranks 1, 2 join as
    processes 2, 3, and the order's device map (0, 2, 1, 3), as the control plane plans it,
    gives new rank 1 (stage 0) to old rank 1 and new rank 2 (stage 1) to old rank 3: every
    survivor keeps its stage. The ranks form the new world under the new numbers, their
    agents renumber them, and training goes on from the next step, verified."""
    from parallelism.layout.catalog import get_model
    from parallelism.planner.plan import PlanOptions, plan_routes

    url, client = broker
    reports: dict[str, list] = {f"node-{i}": [] for i in (1, 2, 3)}
    # node-3's ranks die right after step 3, before the step boundary: every survivor then
    # fails in that boundary, after step 3 (killed at a random moment of a pipelined step,
    # stage 0 may have stepped and stage 1 not: survivors that disagree, no recovery).
    dies = {"node-3": {"DYNAPLANE_FAULT": "exit-after-step:4:3,exit-after-step:5:3"}}
    runners = [JobRunner(reports[f"node-{i}"].append, f"node-{i}", "cpu", url, tmp_path / f"node-{i}",
                         env=dies.get(f"node-{i}")) for i in (1, 2, 3)]
    port = free_loopback_port()
    try:
        for runner, ranks in zip(runners, ([0, 1], [2, 3], [4, 5])):
            runner.start(start_order(25, 6, ranks, port, layout="pp=2,dp=3").model_copy(
                update={"global_batch": 6, "timeout_seconds": 90}))
        orphaned = wait_until(lambda: (o := [r for n in ("node-1", "node-2") for r in reports[n]
                                             if r.kind == "orphaned"])
                              and sorted(x for r in o for x in r.ranks) == [0, 1, 2, 3] and o, 90, "four orphaned")
        (step,) = {r.step for r in orphaned}
        assert step == 3
        # (the queue is kept: rank 0 is the same process, its old world's last batch may still come)
        plan = plan_routes(get_model("tiny-gpt"), "pp=2", "pp=2,dp=2",
                           PlanOptions(gpus_per_node=2, staging_bytes=64 * 2**20, map_ranks=True))
        assert plan.process_of.tolist() == [0, 2, 1, 3]
        order = protocol.JobRecoverOrder(
            job_id=25, restore_id=7, step=step, rendezvous=f"127.0.0.1:{free_loopback_port()}", src_layout="pp=2",
            src_world=2, layout="pp=2,dp=2", world=4, union_world=4, gpus_per_node=2, process_of=(0, 2, 1, 3),
            ranks=(protocol.RankMove(old=0, new=0), protocol.RankMove(old=3, new=1),
                   protocol.RankMove(old=1, new=2), protocol.RankMove(old=2, new=3)))
        runners[0].recover(order.model_copy(update={"ranks": order.ranks[::2]}))  # node-1: old 0, 1
        runners[1].recover(order.model_copy(update={"ranks": order.ranks[1::2]}))  # node-2: old 3, 2
        def recovered_steps() -> list[dict]:
            return [r for r in reports_of_job(client, 25) if r["kind"] == "step" and r["restore_id"] == 7]

        wait_until(lambda: len(recovered_steps()) >= 2, 180, "steps in the survivors' world")
        steps = recovered_steps()
        assert [r["step"] for r in steps[:2]] == [step + 1, step + 2] and all(r["restore_id"] == 7 for r in steps)
        (committed,) = [r for r in (protocol.TransitionReport.model_validate(m) for m in
                                    broker_messages(client, protocol.CONTROL_TRANSITION_REPORT, 25))
                        if r.transition_id == 7 and r.state == "committed"]
        assert committed.verified is True and all(check.match for check in committed.tensors)
        assert committed.fingerprint == plan.fingerprint and committed.network_bytes == plan.network_bytes
        assert plan.network_bytes < plan.summary()["contract_order_network_bytes"]
        # old 0 -> rank 0, old 1 -> process 2 -> rank 1 (node-1); old 3 -> process 1 -> rank 2, old 2 -> rank 3
        wait_until(lambda: runners[0].running() == {25: [0, 1]} and runners[1].running() == {25: [2, 3]}, 30,
                   "the agents to renumber their processes")
    finally:
        for runner in runners:
            runner.shutdown()
