"""Issue 29's parallelisms through the agents: a job on one agent's 4 rank processes (real
gloo world, real Redis) trains tiny-gpt-5l (5 layers, 2 kv heads) with its kv heads
replicated (tp=4) and is switched online, at the agents' step boundary, into an
interleaved pipeline (pp=2,vpp=2,dp=2): the ranks verify the switch bit-exact, report it
committed, and the losses are exactly those of a run that trains the old layout up to the
switch's step, checkpoints there and restarts on the new one (two independent exact state
transfers: the engine's and DCP's).
Likewise tiny-moe (8 experts) from expert parallelism over four ranks (dp=4,ep=4) into
MoE with tensor and expert parallelism (tp=2,dp=2,ep=2), and tiny-gpt from context
parallelism (tp=2,cp=2) into pp=2,dp=2."""
from __future__ import annotations

import pytest

from agents import protocol
from agents.node.jobs import JobRunner
from tests.agents.node.test_job_runner import (broker, broker_messages, free_loopback_port,  # noqa: F401 (fixture)
                                               reports_of_job, restarted_losses, switch_steps,
                                               wait_until)

CASES = [("tiny-gpt-5l", "tp=4,zero=1", "pp=2,vpp=2,dp=2,zero=1", 71),
         ("tiny-moe", "dp=4,ep=4,zero=1", "tp=2,dp=2,ep=2,zero=1", 74),
         ("tiny-gpt", "tp=2,cp=2,zero=1", "pp=2,dp=2,zero=1", 77)]  # (model, start, target, first job id)


def transitions(client, job_id: int) -> list[dict]:
    return broker_messages(client, protocol.CONTROL_TRANSITION_REPORT, job_id)


def _start(job_id: int, model: str, layout: str) -> protocol.JobStartOrder:
    return protocol.JobStartOrder(job_id=job_id, job_name=f"job-{job_id}", model=model, layout=layout, world=4,
                                  global_batch=4, micro_batch=1, seq=16, rendezvous=f"127.0.0.1:{free_loopback_port()}",
                                  timeout_seconds=90, ranks=[protocol.RankSlot(rank=r, gpu=r) for r in range(4)])


@pytest.mark.timeout(420)
@pytest.mark.parametrize("model,src,dst,job", CASES, ids=["kv-heads-to-vpp", "ep-to-tp-ep", "cp-to-pp-dp"])
def test_new_parallelisms_switch_online_through_an_agent(broker, tmp_path, model, src, dst, job):  # noqa: F811
    url, client = broker
    failures: list = []
    node = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "n1")
    start = _start(job, model, src)
    try:
        node.start(start)
        wait_until(lambda: [r for r in reports_of_job(client, job) if r["kind"] == "step"][1:], 120, "two steps")
        node.switch(protocol.JobSwitchOrder(
            job_id=job, transition_id=1, job_name=f"job-{job}", model=model, global_batch=4, micro_batch=1, seq=16,
            timeout_seconds=90, src_layout=src, src_world=4, layout=dst, world=4,
            rendezvous=f"127.0.0.1:{free_loopback_port()}", gpus_per_node=4,
            ranks=[protocol.RankSlot(rank=r, gpu=r) for r in range(4)]))
        (done,) = wait_until(lambda: [t for t in transitions(client, job) if t["state"] == "committed"], 180,
                             "the switch to commit")
        assert done["verified"] is True and done["network_bytes"] > 0
        first_after = max(r["step"] for r in reports_of_job(client, job) if r["kind"] == "step")
        wait_until(lambda: max(r["step"] for r in reports_of_job(client, job) if r["kind"] == "step")
                   >= first_after + 2, 90, "two steps on the new layout")
        node.stop(protocol.JobStopOrder(job_id=job))
        wait_until(lambda: not node.running(), 60, "every rank to exit")
        assert failures == []
        steps = [r for r in reports_of_job(client, job) if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # no step lost or repeated
        assert {r["layout"] for r in steps} == {src, dst}
    finally:
        node.shutdown()

    ends = switch_steps(steps, [src, dst])
    # Equal, not close: a switch that lost or perturbed any state (a moment, a step count,
    # a shard placed on the wrong rank) changes the losses after it.
    assert [r["loss"] for r in steps] == restarted_losses(client, url, tmp_path, start,
                                                          ((job + 1, src, 4, ends[0]), (job + 2, dst, 4, ends[1])))
