"""The agent's job runner with real rank processes, a real gloo world and real Redis:
rank 0's reports travel through the broker exactly as in the product (read back here
from the control queue's Redis list instead of by a control-plane worker)."""
from __future__ import annotations

import base64
import json
import os
import signal
import socket
import time
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis

from agents import protocol
from agents.node.jobs import JobRunner
from agents.runtime.checkpoints import complete_checkpoints

pytestmark = pytest.mark.timeout(240)


def _broker_url() -> str:
    return urlunsplit(urlsplit(os.environ["REDIS_URL"])._replace(path="/5"))


@pytest.fixture
def broker():
    url = _broker_url()
    client = redis.Redis.from_url(url)
    client.delete(protocol.CONTROL_QUEUE)
    yield url, client
    client.delete(protocol.CONTROL_QUEUE)


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_order(job_id: int, world: int, ranks: list[int], port: int, layout: str = "dp=2", max_steps=None):
    return protocol.JobStartOrder(job_id=job_id, job_name=f"job-{job_id}", model="tiny-gpt", layout=layout,
                                  world=world, global_batch=4, micro_batch=1, seq=16,
                                  rendezvous=f"127.0.0.1:{port}", max_steps=max_steps, timeout_seconds=60,
                                  ranks=[protocol.RankSlot(rank=r, gpu=i) for i, r in enumerate(ranks)])


def broker_messages(client, task: str, job_id: int | None = None) -> list[dict]:
    """Messages rank 0 (or an agent) sent through the broker for `task`, oldest first
    (Celery's Redis transport keeps a queue as a list of JSON envelopes whose body is the
    base64 JSON [args, kwargs, options]; LPUSH puts the newest first)."""
    out = []
    for raw in reversed(client.lrange(protocol.CONTROL_QUEUE, 0, -1)):
        envelope = json.loads(raw)
        if envelope["headers"]["task"] == task:
            args, _, _ = json.loads(base64.b64decode(envelope["body"]))
            if job_id is None or args[0]["job_id"] == job_id:
                out.append(args[0])
    return out


def _job_report_messages(client, job_id: int | None = None) -> list[dict]:
    """JobReports in the order sent: alone (from an agent) or in rank 0's batches, whose
    numbers count up from 1 (each validated against the protocol)."""
    out, numbers = [], {}
    for raw in reversed(client.lrange(protocol.CONTROL_QUEUE, 0, -1)):
        envelope = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(envelope["body"]))
        if job_id is not None and args[0]["job_id"] != job_id:
            continue
        if envelope["headers"]["task"] == protocol.CONTROL_JOB_REPORT:
            out.append(protocol.JOB_REPORTS.validate_python(args[0]).model_dump())
        elif envelope["headers"]["task"] == protocol.CONTROL_INGEST_EVENTS:
            batch = protocol.ReportBatch.model_validate(args[0])
            assert batch.batch == numbers.get(batch.stream, 0) + 1, (batch.stream, batch.batch, numbers)
            numbers[batch.stream] = batch.batch
            out += [report.model_dump() for report in batch.reports]
    return out


def sent_reports(client) -> list[dict]:
    """Every JobReport sent; nothing else was sent."""
    assert all(json.loads(raw)["headers"]["task"] in (protocol.CONTROL_JOB_REPORT, protocol.CONTROL_INGEST_EVENTS)
               for raw in client.lrange(protocol.CONTROL_QUEUE, 0, -1))
    return _job_report_messages(client)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_job_over_two_agents_trains_reports_and_stops_on_request(broker, tmp_path):
    url, client = broker
    failures: list = []
    port = free_loopback_port()
    runners = [JobRunner(failures.append, f"node-{i}", "cpu", url, tmp_path / f"node-{i}") for i in (1, 2)]
    try:
        runners[0].start(start_order(7, 2, [0], port))
        runners[1].start(start_order(7, 2, [1], port))
        wait_until(lambda: len([r for r in sent_reports(client) if r["kind"] == "step"]) >= 2, 120, "two step reports")
        steps = [r for r in sent_reports(client) if r["kind"] == "step"][:2]
        assert [r["step"] for r in steps] == [1, 2]
        assert all(r["loss"] > 0 and r["step_seconds"] > 0 and r["tokens_per_second"] > 0 for r in steps)
        assert sent_reports(client)[0]["kind"] == "started"
        for runner in runners:
            runner.stop(protocol.JobStopOrder(job_id=7))
        wait_until(lambda: all(not r.running() for r in runners), 60, "every rank to exit")
        reports = sent_reports(client)
        assert reports[-1]["kind"] == "stopped" and reports[-1]["step"] == max(r["step"] or 0 for r in reports)
        assert failures == []
        logs = sorted(p.name for p in (tmp_path / "node-2" / "job-7").iterdir())
        assert "rank-1.log" in logs and "stop" in logs
    finally:
        for runner in runners:
            runner.shutdown()


def test_max_steps_ends_the_job_on_every_rank_after_the_same_step(broker, tmp_path):
    url, client = broker
    runner = JobRunner([].append, "node-1", "cpu", url, tmp_path)
    try:
        runner.start(start_order(8, 2, [0, 1], free_loopback_port(), max_steps=3))
        wait_until(lambda: not runner.running(), 120, "the job to end")
        kinds = [(r["kind"], r["step"]) for r in sent_reports(client)]
        assert kinds == [("started", 1), ("step", 1), ("step", 2), ("step", 3), ("stopped", 3)]
    finally:
        runner.shutdown()


def test_ranks_outliving_the_stop_grace_are_killed_and_rank_0s_agent_reports_stopped(broker, tmp_path):
    """A step longer than the grace period (llama-124m on a loaded CPU box): the agent kills
    the ranks and, holding rank 0 (which would have said it), reports the job stopped."""
    url, client = broker
    sent: list[protocol.JobReport] = []
    runner = JobRunner(sent.append, "node-1", "cpu", url, tmp_path)
    try:
        runner.start(start_order(10, 2, [0], free_loopback_port()))  # rank 1 never comes: rank 0 waits at the rendezvous
        runner.stop(protocol.JobStopOrder(job_id=10, grace_seconds=0.5))
        wait_until(lambda: not runner.running(), 30, "the ranks to be killed")
        assert [(r.kind, r.job_id, r.node) for r in sent] == [("stopped", 10, "node-1")]
        assert "grace period" in sent[0].error
    finally:
        runner.shutdown()


def test_a_dead_rank_is_reported_and_its_peers_are_not_left_behind(broker, tmp_path):
    url, client = broker
    failures: list[protocol.JobReport] = []
    runner = JobRunner(failures.append, "node-1", "cpu", url, tmp_path)
    try:
        runner.start(start_order(9, 2, [0, 1], free_loopback_port()))
        wait_until(lambda: [r for r in sent_reports(client) if r["kind"] == "step"], 120, "a step report")
        victim = runner.jobs[9].ranks[1].process
        os.kill(victim.pid, signal.SIGKILL)
        wait_until(lambda: failures, 30, "the failure report")
        assert failures[0].kind == "failed" and failures[0].ranks == (1,) and failures[0].job_id == 9
        assert "rank 1 on node node-1 exited with code -9" in failures[0].error
        wait_until(lambda: not runner.running(), 30, "rank 0 to be stopped too")
        assert len(failures) == 1
    finally:
        runner.shutdown()


def test_a_duplicate_start_order_is_ignored(broker, tmp_path):
    url, client = broker
    runner = JobRunner([].append, "node-1", "cpu", url, tmp_path)
    try:
        order = start_order(10, 1, [0], free_loopback_port(), layout="dp=1", max_steps=2)
        runner.start(order)
        runner.start(order)
        wait_until(lambda: not runner.running() and sent_reports(client) and sent_reports(client)[-1]["kind"] == "stopped",
              120, "the job to end")
        assert [r["kind"] for r in sent_reports(client)].count("started") == 1
    finally:
        runner.shutdown()


def _transitions(client, job_id: int) -> list[dict]:
    return broker_messages(client, protocol.CONTROL_TRANSITION_REPORT, job_id)


def reports_of_job(client, job_id: int) -> list[dict]:
    return _job_report_messages(client, job_id)


def _switch(job_id: int, tid: int, src: str, src_world: int, dst: str, world: int, ranks: list[tuple[int, int]]):
    return protocol.JobSwitchOrder(job_id=job_id, transition_id=tid, job_name=f"job-{job_id}", model="tiny-gpt",
                                   global_batch=6, micro_batch=1, seq=16, timeout_seconds=90, src_layout=src,
                                   src_world=src_world, layout=dst, world=world,
                                   rendezvous=f"127.0.0.1:{free_loopback_port()}", gpus_per_node=2,
                                   ranks=[protocol.RankSlot(rank=r, gpu=g) for r, g in ranks])


def restarted_losses(client, url: str, tmp_path, start: protocol.JobStartOrder,
                     segments: tuple[tuple[int, str, int, int], ...]) -> list[float]:
    """The exact reference of a run switched online through several layouts: the same job
    trained on each (job id, layout, world, last step) of `segments` in turn, checkpointed
    with DCP at the segment's last step and restarted from that checkpoint in the next
    segment's layout. Both state transfers (the engine's switch and DCP's resharding) are
    exact and independent, so the switched run's losses must equal these bit for bit (a
    bound by the layouts' noise is not sound: a run switched at step k follows its own
    trajectory, which compounding can take outside it). Returns the losses, steps 1 to the
    last segment's last step."""
    failed: list = []
    reference = JobRunner(failed.append, "node-1", "cpu", url, tmp_path / "ref")
    root = tmp_path / "ref-ckpt"
    losses: list[float] = []
    restore: dict = {}
    try:
        for job_id, layout, world, last in segments:
            reference.start(start.model_copy(update={
                "job_id": job_id, "layout": layout, "world": world, "max_steps": last,
                "ranks": tuple(protocol.RankSlot(rank=r, gpu=r) for r in range(world)),
                "rendezvous": f"127.0.0.1:{free_loopback_port()}", "checkpoint_interval": last,
                "checkpoint_dir": str(root / str(job_id)), **restore}))
            wait_until(lambda: not reference.running(), 180, f"the reference run on {layout}")
            reports = reports_of_job(client, job_id)
            if restore:
                (restored,) = [r for r in reports if r["kind"] == "restored"]
                assert (restored["step"], restored["verified"]) == (len(losses), True), restored
            losses += [r["loss"] for r in reports if r["kind"] == "step"]
            assert len(losses) == last, (layout, len(losses), last)
            (saved,) = [r for r in reports if r["kind"] == "checkpoint" and r["step"] == last]
            restore = {"restore_from": saved["checkpoint_path"], "restore_id": job_id}
    finally:
        reference.shutdown()
    assert failed == []
    return losses


def switch_steps(steps: list[dict], layouts: list[str]) -> list[int]:
    """The last step each layout of a switched run trained (its steps run through `layouts`
    in order, each for at least one step)."""
    assert [r["layout"] for r in steps] == sorted((r["layout"] for r in steps), key=layouts.index), steps
    return [max(r["step"] for r in steps if r["layout"] == layout) for layout in layouts]


@pytest.mark.timeout(420)
def test_a_job_grows_from_two_to_four_ranks_and_shrinks_to_three_while_training(broker, tmp_path):
    """The issue's resize: 2 -> 4 -> 3 ranks over two agents, online. Each switch is
    verified bit-exact by the ranks (digests) and reported committed with its timings; the
    step count carries on; the losses equal, bit for bit, those of a run that trains each
    layout up to its switch's step, checkpoints there and restarts on the next layout
    (restarted_losses)."""
    url, client = broker
    failures: list = []
    node1 = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "n1")
    node2 = JobRunner(failures.append, "node-2", "cpu", url, tmp_path / "n2")
    try:
        start = start_order(21, 2, [0, 1], free_loopback_port(), layout="dp=2").model_copy(update={"global_batch": 6})
        node1.start(start)
        wait_until(lambda: [r for r in reports_of_job(client, 21) if r["kind"] == "step"][1:], 120, "two steps")
        grow = _switch(21, 1, "dp=2", 2, "tp=2,dp=2", 4, [(0, 0), (1, 1)])
        node1.switch(grow)
        node2.switch(grow.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                       protocol.RankSlot(rank=3, gpu=1))}))
        committed = wait_until(lambda: [t for t in _transitions(client, 21) if t["state"] == "committed"], 180,
                          "the grow to commit")
        shrink = _switch(21, 2, "tp=2,dp=2", 4, "dp=3", 3, [(0, 0), (1, 1)])
        node1.switch(shrink)
        node2.switch(shrink.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                         protocol.RankSlot(rank=3, gpu=1))}))
        wait_until(lambda: len([t for t in _transitions(client, 21) if t["state"] == "committed"]) == 2, 180,
              "the shrink to commit")
        wait_until(lambda: node2.running().get(21) == [2], 60, "rank 3 to leave")
        first_after = max(r["step"] for r in reports_of_job(client, 21) if r["kind"] == "step")
        wait_until(lambda: max(r["step"] for r in reports_of_job(client, 21) if r["kind"] == "step") >= first_after + 2,
              60, "two steps on three ranks")
        for runner in (node1, node2):
            runner.stop(protocol.JobStopOrder(job_id=21))
        wait_until(lambda: not node1.running() and not node2.running(), 60, "every rank to exit")
        assert failures == []

        transitions = _transitions(client, 21)
        for transition_id in (1, 2):
            # Rank 0 reports `transferring` once per progress update ("round k of R"), so the
            # lifecycle is the sequence of distinct consecutive states.
            states = [t["state"] for t in transitions if t["transition_id"] == transition_id]
            assert [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s] == [
                "preparing", "ready", "transferring", "verifying", "committed"], states
        verifying = [t for t in transitions if t["state"] == "verifying"]
        assert all(t["transfer_seconds"] > 0 for t in verifying)
        for t in (t for t in transitions if t["state"] == "committed"):
            assert t["verified"] is True and t["transfer_seconds"] > 0 and t["pause_seconds"] >= t["transfer_seconds"]
            assert t["network_bytes"] > 0 and t["fingerprint"]
        assert committed[0]["step"] >= 2
        steps = [r for r in reports_of_job(client, 21) if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))  # no step lost or repeated
        assert {r["layout"] for r in steps} == {"dp=2", "tp=2,dp=2", "dp=3"}
    finally:
        node1.shutdown()
        node2.shutdown()

    ends = switch_steps(steps, ["dp=2", "tp=2,dp=2", "dp=3"])
    assert [r["loss"] for r in steps] == restarted_losses(client, url, tmp_path, start, (
        (22, "dp=2", 2, ends[0]), (23, "tp=2,dp=2", 4, ends[1]), (24, "dp=3", 3, ends[2])))

@pytest.mark.timeout(420)
def test_a_switch_under_a_device_map_renumbers_the_ranks_and_trains_as_an_unswitched_run(broker, tmp_path):
    """pp=2,dp=2 -> pp=2 with the device map the control plane chooses (process_of=(0, 2)):
    process 2 (node-2), which holds stage 1, becomes rank 1 and nothing crosses the
    network. The new world is formed with the new numbers, node-2's agent renumbers its
    process, process 1 and 3 leave; the losses equal a run checkpointed at the switch's step
    and restarted on pp=2."""
    url, client = broker
    failures: list = []
    node1 = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "n1")
    node2 = JobRunner(failures.append, "node-2", "cpu", url, tmp_path / "n2")
    start = start_order(61, 4, [0, 1], free_loopback_port(), layout="pp=2,dp=2").model_copy(
        update={"global_batch": 6})
    try:
        node1.start(start)
        node2.start(start.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                       protocol.RankSlot(rank=3, gpu=1))}))
        wait_until(lambda: [r for r in reports_of_job(client, 61) if r["kind"] == "step"][1:], 120, "two steps")
        shrink = _switch(61, 1, "pp=2,dp=2", 4, "pp=2", 2, [(0, 0), (1, 1)]).model_copy(
            update={"process_of": (0, 2)})
        node1.switch(shrink)
        node2.switch(shrink.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                         protocol.RankSlot(rank=3, gpu=1))}))
        (done,) = wait_until(lambda: [t for t in _transitions(client, 61) if t["state"] == "committed"], 180,
                             "the switch to commit")
        assert done["verified"] is True and done["network_bytes"] == 0
        wait_until(lambda: node1.running().get(61) == [0] and node2.running().get(61) == [1], 60,
                   "processes 1 and 3 to leave and process 2 to be rank 1")
        first_after = max(r["step"] for r in reports_of_job(client, 61) if r["kind"] == "step")
        wait_until(lambda: max(r["step"] for r in reports_of_job(client, 61) if r["kind"] == "step")
                   >= first_after + 2, 60, "two steps after the switch")
        for runner in (node1, node2):
            runner.stop(protocol.JobStopOrder(job_id=61))
        wait_until(lambda: not node1.running() and not node2.running(), 60, "every rank to exit")
        assert failures == []
        steps = [r for r in reports_of_job(client, 61) if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
        assert {r["layout"] for r in steps} == {"pp=2,dp=2", "pp=2"}
    finally:
        node1.shutdown()
        node2.shutdown()

    ends = switch_steps(steps, ["pp=2,dp=2", "pp=2"])
    assert [r["loss"] for r in steps] == restarted_losses(client, url, tmp_path, start,
                                                          ((62, "pp=2,dp=2", 4, ends[0]), (63, "pp=2", 2, ends[1])))

@pytest.mark.timeout(300)
def test_a_joining_rank_lost_while_preparing_aborts_the_switch_and_the_job_trains_on(broker, tmp_path):
    """Issue 6's first fault: a rank lost while the switch is being prepared. The old layout
    never left, so the switch is aborted (reported by the joining rank's agent and by rank
    0), the job is not failed and keeps training on its old layout and ranks."""
    url, client = broker
    failures: list = []
    node1 = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "n1")
    node2 = JobRunner(failures.append, "node-2", "cpu", url, tmp_path / "n2")
    try:
        node1.start(start_order(31, 2, [0, 1], free_loopback_port(), layout="dp=2").model_copy(update={"global_batch": 6}))
        wait_until(lambda: [r for r in reports_of_job(client, 31) if r["kind"] == "step"], 120, "a step")
        grow = _switch(31, 5, "dp=2", 2, "tp=2,dp=2", 4, [(0, 0), (1, 1)]).model_copy(
            update={"timeout_seconds": 30})
        node1.switch(grow)
        node2.switch(grow.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                       protocol.RankSlot(rank=3, gpu=1))}))
        victim = wait_until(lambda: 31 in node2.jobs and 2 in node2.jobs[31].ranks and node2.jobs[31].ranks[2].process,
                       30, "rank 2 to start")
        os.kill(victim.pid, signal.SIGKILL)
        aborted = wait_until(lambda: [f for f in failures if isinstance(f, protocol.TransitionReport)], 30,
                        "the agent's abort report")
        assert aborted[0].state == "aborted" and aborted[0].transition_id == 5
        assert "joining rank 2 on node node-2 exited with code -9 before the switch" in aborted[0].error
        from_rank0 = wait_until(lambda: [t for t in _transitions(client, 31) if t["state"] == "aborted"], 60,
                           "rank 0 to abandon the switch")
        assert "switch abandoned: joining rank 2" in from_rank0[0]["error"]
        assert not [t for t in _transitions(client, 31) if t["state"] in ("ready", "transferring", "committed")]
        wait_until(lambda: 31 not in node2.running(), 30, "node-2's joining ranks to be gone")
        last = max(r["step"] for r in reports_of_job(client, 31) if r["kind"] == "step")
        wait_until(lambda: max(r["step"] for r in reports_of_job(client, 31) if r["kind"] == "step") >= last + 3, 60,
              "three more steps")
        steps = [r for r in reports_of_job(client, 31) if r["kind"] == "step"]
        assert {r["layout"] for r in steps} == {"dp=2"} and node1.running()[31] == [0, 1]
        assert not [f for f in failures if not isinstance(f, protocol.TransitionReport)]  # the job never failed
        node1.stop(protocol.JobStopOrder(job_id=31))
        wait_until(lambda: not node1.running(), 60, "the job to stop")
        assert reports_of_job(client, 31)[-1]["kind"] == "stopped"
    finally:
        node1.shutdown()
        node2.shutdown()


@pytest.mark.timeout(300)
def test_a_joining_rank_lost_during_the_transfer_rolls_the_job_back_to_its_old_layout(broker, tmp_path):
    """Issue 6's second fault: a rank lost after the old ranks left their layout (here a
    joining rank exits right after entering the union world, by fault injection). The old
    ranks kept their state until the commit point: they form the old world again and train
    on, with the step count and losses of a job that never switched; rank 0 reports
    rolled_back with the reason, the job is not failed."""
    url, client = broker
    failures: list = []
    node1 = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "n1")
    node2 = JobRunner(failures.append, "node-2", "cpu", url, tmp_path / "n2",
                      env={"DYNAPLANE_FAULT": "exit-in-transfer:2"})
    try:
        start = start_order(41, 2, [0, 1], free_loopback_port(), layout="dp=2").model_copy(update={"global_batch": 6})
        node1.start(start)
        wait_until(lambda: [r for r in reports_of_job(client, 41) if r["kind"] == "step"], 120, "a step")
        grow = _switch(41, 7, "dp=2", 2, "tp=2,dp=2", 4, [(0, 0), (1, 1)]).model_copy(update={"timeout_seconds": 20})
        node1.switch(grow)
        node2.switch(grow.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                       protocol.RankSlot(rank=3, gpu=1))}))
        back = wait_until(lambda: [t for t in _transitions(client, 41) if t["state"] == "rolled_back"], 120,
                     "rank 0 to roll back")
        assert [t["state"] for t in _transitions(client, 41)] == ["preparing", "ready", "transferring",
                                                                  "rolled_back"]
        assert back[0]["error"].startswith("switch failed, back on dp=2:")
        at = back[0]["step"]
        wait_until(lambda: max(r["step"] for r in reports_of_job(client, 41) if r["kind"] == "step") >= at + 3, 60,
              "three steps after the rollback")
        wait_until(lambda: 41 not in node2.running(), 60, "node-2's joining ranks to be gone")
        node1.stop(protocol.JobStopOrder(job_id=41))
        wait_until(lambda: not node1.running(), 60, "the job to stop")
        assert failures == []  # neither the job failed nor the switch was reported aborted
        steps = [r for r in reports_of_job(client, 41) if r["kind"] == "step"]
        assert [r["step"] for r in steps] == list(range(1, len(steps) + 1))
        assert {r["layout"] for r in steps} == {"dp=2"}
    finally:
        node1.shutdown()
        node2.shutdown()

    # The rolled-back job's losses are the unswitched job's, step for step, to the bit: same
    # layout, same state (kept until the commit point), same data.
    failed: list = []
    reference = JobRunner(failed.append, "node-1", "cpu", url, tmp_path / "ref")
    try:
        reference.start(start.model_copy(update={"job_id": 42, "max_steps": len(steps),
                                                 "rendezvous": f"127.0.0.1:{free_loopback_port()}"}))
        wait_until(lambda: not reference.running(), 180, "the unswitched run")
    finally:
        reference.shutdown()
    unswitched = [r["loss"] for r in reports_of_job(client, 42) if r["kind"] == "step"]
    assert [r["loss"] for r in steps] == unswitched


@pytest.mark.timeout(300)
def test_a_cancelled_switch_is_dropped_by_rank_0_at_once_and_the_job_trains_on(broker, tmp_path):
    """The control plane cancels a switch whose joining node was lost (the node-2 runner
    and its ranks are gone): rank 0 drops it at the next step boundary, long before the
    job's 120 s timeout, and a later switch still works."""
    url, client = broker
    failures: list = []
    node1 = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "n1")
    node2 = JobRunner(failures.append, "node-2", "cpu", url, tmp_path / "n2")
    try:
        node1.start(start_order(51, 2, [0, 1], free_loopback_port(), layout="dp=2").model_copy(update={"global_batch": 6}))
        wait_until(lambda: [r for r in reports_of_job(client, 51) if r["kind"] == "step"], 120, "a step")
        grow = _switch(51, 9, "dp=2", 2, "tp=2,dp=2", 4, [(0, 0), (1, 1)]).model_copy(update={"timeout_seconds": 120})
        node1.switch(grow)
        node2.switch(grow.model_copy(update={"ranks": (protocol.RankSlot(rank=2, gpu=0),
                                                       protocol.RankSlot(rank=3, gpu=1))}))
        wait_until(lambda: [t for t in _transitions(client, 51) if t["state"] == "preparing"], 60, "preparing")
        node2.shutdown()  # the joining node is lost with its ranks
        started = time.monotonic()
        node1.cancel(protocol.JobSwitchCancel(job_id=51, transition_id=9, reason="node node-2 lost"))
        aborted = wait_until(lambda: [t for t in _transitions(client, 51) if t["state"] == "aborted"], 60,
                        "rank 0 to drop the switch")
        assert time.monotonic() - started < 30
        assert "cancelled by the control plane: node node-2 lost" in aborted[0]["error"]
        last = max(r["step"] for r in reports_of_job(client, 51) if r["kind"] == "step")
        wait_until(lambda: max(r["step"] for r in reports_of_job(client, 51) if r["kind"] == "step") >= last + 2, 60,
              "two more steps")
        assert not [t for t in _transitions(client, 51) if t["state"] in ("ready", "transferring", "committed")]
        # A later switch (here to dp=1, a shrink needing no new rank) is taken up and commits.
        node1.switch(_switch(51, 10, "dp=2", 2, "dp=1", 1, [(0, 0), (1, 1)]).model_copy(
            update={"global_batch": 6}))
        wait_until(lambda: [t for t in _transitions(client, 51) if t["state"] == "committed"], 60, "the shrink")
        node1.stop(protocol.JobStopOrder(job_id=51))
        wait_until(lambda: not node1.running(), 60, "the job to stop")
        assert not [f for f in failures if not isinstance(f, protocol.TransitionReport)]
    finally:
        node1.shutdown()
        node2.shutdown()


def test_periodic_checkpoints_and_a_restart_from_one_on_fewer_ranks(broker, tmp_path):
    """Ranks checkpoint every 2 steps with DCP (rank 0 reports each; only the last 3 stay);
    after a rank dies, a restart order makes a new world load the latest checkpoint: in the
    same layout it trains on bit-identically (the same losses the first world had at the
    same steps), in a smaller one (dp=1, DCP reshards) the loaded state's digests match."""
    url, client = broker
    failures: list = []
    root = tmp_path / "ckpt"
    runner = JobRunner(failures.append, "node-1", "cpu", url, tmp_path / "run")

    def order(port, **fields):
        return start_order(11, 2, [0, 1], port).model_copy(update={"checkpoint_interval": 2,
                                                               "checkpoint_dir": str(root), **fields})
    try:
        runner.start(order(free_loopback_port()))
        wait_until(lambda: len([r for r in sent_reports(client) if r["kind"] == "checkpoint"]) >= 4, 180, "four checkpoints")
        os.kill(runner.jobs[11].ranks[1].process.pid, signal.SIGKILL)
        wait_until(lambda: failures, 30, "the failure report")
        wait_until(lambda: not runner.running(), 30, "rank 0 to be stopped too")  # (its reports are all sent then)
        reports = sent_reports(client)
        checkpoints = [r for r in reports if r["kind"] == "checkpoint"]
        assert [r["step"] for r in checkpoints[:4]] == [2, 4, 6, 8]
        assert all(r["seconds"] > 0 and r["checkpoint_path"].startswith(str(root)) for r in checkpoints)
        first_losses = {r["step"]: r["loss"] for r in reports if r["kind"] == "step"}
        latest = checkpoints[-1]
        kept = sorted(p.name for p in root.iterdir())
        complete = [p.name for p in complete_checkpoints(root)]
        # 3 complete, the latest reported last (+ one a rank was writing when the job died)
        assert len(complete) == 3 and len(kept) <= 4 and complete[-1] == f"step-{latest['step']:08d}-0", kept
        # The same layout, restarted from a checkpoint whose next steps the first world ran.
        back = checkpoints[-2]
        client.delete(protocol.CONTROL_QUEUE)
        runner.start(order(free_loopback_port(), restore_from=back["checkpoint_path"], restore_id=1))
        wait_until(lambda: len([r for r in sent_reports(client) if r["kind"] == "step"]) >= 2, 120, "steps after the restart")
        reports = sent_reports(client)
        (restored,) = [r for r in reports if r["kind"] == "restored"]
        assert (restored["step"], restored["verified"], restored["restore_id"]) == (back["step"], True, 1)
        steps = [r for r in reports if r["kind"] == "step"][:2]
        assert [r["step"] for r in steps] == [back["step"] + 1, back["step"] + 2]
        assert [r["loss"] for r in steps] == [first_losses[back["step"] + 1], first_losses[back["step"] + 2]]
        # A restart on one rank (dp=1) from the latest: the state is resharded and verified.
        client.delete(protocol.CONTROL_QUEUE)
        one = start_order(11, 1, [0], free_loopback_port(), layout="dp=1").model_copy(update={
            "checkpoint_interval": 2, "checkpoint_dir": str(root), "restore_from": latest["checkpoint_path"],
            "restore_id": 2})
        runner.start(one)
        wait_until(lambda: [r for r in sent_reports(client) if r["kind"] == "step"], 120, "a step on one rank")
        (restored,) = [r for r in sent_reports(client) if r["kind"] == "restored"]
        assert (restored["step"], restored["verified"], restored["layout"]) == (latest["step"], True, "dp=1")
        assert len(failures) == 1  # the killed ranks of the replaced worlds are not reported
        print(f"checkpoint pause {[round(r['seconds'], 3) for r in checkpoints]} s; restore {restored['seconds']:.2f} s")
    finally:
        runner.shutdown()


def test_a_job_on_a_dataset_from_hugging_face_weights_reports_validation_loss(broker, tmp_path):
    """Issue 42 through the agent: the ranks start from a Hugging Face model's weights, read a
    dataset, report the validation loss with every second step, and record what they read."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from agents.runtime.sample_log import consumed, gaps_and_repeats, read_records
    from parallelism.datasets.dataset import TokenDataset
    from tests.parallelism.datasets.conftest import make_dataset
    from tests.parallelism.hf_weights.tiny_hf import VOCAB, build_hf_model, save_hf_model

    url, client = broker
    hf = save_hf_model("llama", tmp_path / "hf")
    rng = np.random.default_rng(3)
    data = make_dataset(tmp_path / "data", [rng.integers(1, VOCAB, 50).tolist() for _ in range(40)], vocab=VOCAB,
                        fraction=0.1)
    runner = JobRunner([].append, "node-1", "cpu", url, tmp_path / "node")
    order = start_order(12, 2, [0, 1], free_loopback_port(), layout="tp=2", max_steps=4).model_copy(update={
        "model": str(tmp_path / "hf" / "config.json"), "dataset": str(data), "init_from": hf, "eval_every": 2,
        "eval_batches": 2, "checkpoint_dir": str(tmp_path / "ckpt")})
    try:
        runner.start(order)
        wait_until(lambda: not runner.running(), 180, "the job to end")
        steps = [r for r in sent_reports(client) if r["kind"] == "step"]
        assert [r["step"] for r in steps] == [1, 2, 3, 4]
        assert [r.get("validation_loss") is not None for r in steps] == [False, True, False, True]
        # step 1's loss is the Hugging Face model's on the job's first global batch (bf16 forward)
        tokens, targets = TokenDataset(data, 16, seed=0).batch(0, 4)
        with torch.no_grad():
            logits = build_hf_model("llama").eval()(tokens).logits  # the saved model (same seed)
        expected = float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))
        assert steps[0]["loss"] == pytest.approx(expected, rel=2e-2)
        reads = consumed(read_records(tmp_path / "ckpt"))
        assert list(reads) == [1, 2, 3, 4] and gaps_and_repeats(reads, 4) == []
    finally:
        runner.shutdown()
