"""The job runner with a multimodal model (tiny-vlm, HeteroTrainer) on real rank processes:
periodic checkpoints of a heterogeneous layout and restarts from one, in the same layout
(bit-identical losses) and in another placement (DCP reshards each module; digests match).
Reports are read back from the real broker, as in test_job_runner.py."""
from __future__ import annotations

import os
import signal

import pytest

from agents import protocol
from agents.node.jobs import JobRunner
from tests.agents.node.test_job_runner import free_loopback_port, start_order, sent_reports, wait_until, broker  # noqa: F401 (fixture)

pytestmark = pytest.mark.timeout(300)

# Encoder ZeRO-1 over 4 ranks: ranks 1-3 hold an empty chunk of the 1-row class token.
COLOCATED = "encoder:dp=4,zero=1;llm:tp=2,dp=2"
NON_COLOCATED = "encoder:dp=1,ranks=0-0;llm:dp=2,zero=1,ranks=1-2"


def _vlm_order(job_id: int, layout: str, world: int, root, **fields) -> protocol.JobStartOrder:
    return start_order(job_id, world, list(range(world)), free_loopback_port(), layout=layout).model_copy(update={
        "model": "tiny-vlm", "global_batch": 8, "checkpoint_interval": 2, "checkpoint_dir": str(root), **fields})


def test_a_heterogeneous_job_checkpoints_and_restarts_from_a_checkpoint(broker, tmp_path):  # noqa: F811
    url, client = broker
    failures: list = []
    root = tmp_path / "ckpt"
    runner = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "run")
    try:
        runner.start(_vlm_order(21, COLOCATED, 4, root))
        wait_until(lambda: len([r for r in sent_reports(client) if r["kind"] == "checkpoint"]) >= 3, 180, "three checkpoints")
        os.kill(runner.jobs[21].ranks[3].process.pid, signal.SIGKILL)
        wait_until(lambda: failures, 30, "the failure report")
        wait_until(lambda: not runner.running(), 30, "the other ranks to be stopped")
        reports = sent_reports(client)
        assert [r["layout"] for r in reports if r["kind"] == "started"] == [COLOCATED]
        checkpoints = [r for r in reports if r["kind"] == "checkpoint"]
        assert [r["step"] for r in checkpoints[:3]] == [2, 4, 6]
        first_losses = {r["step"]: r["loss"] for r in reports if r["kind"] == "step"}
        back = checkpoints[-2]

        # The same layout from a checkpoint whose next steps the first world ran: the same losses.
        client.delete(protocol.CONTROL_QUEUE)
        runner.start(_vlm_order(21, COLOCATED, 4, root, restore_from=back["checkpoint_path"], restore_id=1))
        wait_until(lambda: len([r for r in sent_reports(client) if r["kind"] == "step"]) >= 2, 120, "steps after the restart")
        reports = sent_reports(client)
        (restored,) = [r for r in reports if r["kind"] == "restored"]
        assert (restored["step"], restored["verified"]) == (back["step"], True)
        steps = [r for r in reports if r["kind"] == "step"][:2]
        assert [r["step"] for r in steps] == [back["step"] + 1, back["step"] + 2]
        assert [r["loss"] for r in steps] == [first_losses[back["step"] + 1], first_losses[back["step"] + 2]]
        runner.stop(protocol.JobStopOrder(job_id=21, grace_seconds=30))
        wait_until(lambda: not runner.running(), 60, "the restarted job to stop")

        # Non-colocated on 3 ranks: each module's state resharded onto its own ranks, verified.
        client.delete(protocol.CONTROL_QUEUE)
        runner.start(_vlm_order(21, NON_COLOCATED, 3, root, restore_from=back["checkpoint_path"], restore_id=2))
        wait_until(lambda: [r for r in sent_reports(client) if r["kind"] == "step"], 120, "a step on the new placement")
        (restored,) = [r for r in sent_reports(client) if r["kind"] == "restored"]
        assert (restored["step"], restored["verified"], restored["layout"]) == (back["step"], True, NON_COLOCATED)
        assert len(failures) == 1
    finally:
        runner.shutdown()
