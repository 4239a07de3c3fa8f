"""Issue 47: two control worker processes racing on the same jobs, and the database ends consistent.

`dynaplane up --workers 2` (two Celery worker processes of 4 threads each on the same queues, the
first with beat) on PostgreSQL, and 6 nodes x 2 GPUs simulated at the message level on the real
path (tests/support/simulated_agents.py: heartbeats posted to Redis, rank 0's sealed report
batches). At once: four jobs started through the API from four threads; every job's rank 0 sends
its steps one batch each, so both processes' threads take one job's batches in any order; one job
grown from 2 to 4 GPUs while its steps arrive, each of its rank 0's transition reports sent twice
(a redelivery, and both processes may take the two copies); the node under another job falls
silent and is found lost. Then: GPUs are held by exactly the jobs that run, on exactly their
placements; every transition settled, each state entered once; every step recorded once, in
order; and both processes did the work.
"""
from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

import pytest
from celery import Celery

from agents import protocol
from agents.seal import key_of_token, seal
from tests.support.simulated_agents import Heartbeats, RankZeros
from tests.support.stack import stack_of_its_own, wait_for

POSTGRES = os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))
pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(not POSTGRES, reason="two worker processes writing at once need PostgreSQL's row "
                                                      "locks (SQLite has none; `dynaplane up` runs one worker there)")]

REDIS_DB = 12
NODES, GPUS = 6, 2
STEPS = 40
TERMINAL = {"committed", "aborted", "rolled_back"}
LIVE = {"starting", "running", "switching", "restoring", "stopping"}


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    with stack_of_its_own(tmp_path_factory.mktemp("two-workers"), REDIS_DB, agents=0, workers=2,
                          env={"DYNAPLANE_PREFLIGHT": "off"}) as stack:
        yield stack


def database(stack) -> dict:
    """The stack's rows that must agree: GPUs, jobs and transitions."""
    import psycopg

    with psycopg.connect(stack.database_url) as conn:
        gpus = conn.execute("SELECT n.name, g.index, g.state, g.job_id FROM cluster_gpu g "
                            "JOIN cluster_node n ON n.id = g.node_id").fetchall()
        nodes = dict(conn.execute("SELECT name, state FROM cluster_node").fetchall())
        jobs = {row[0]: {"state": row[1], "placement": row[2] if isinstance(row[2], list) else json.loads(row[2])}
                for row in conn.execute("SELECT id, state, placement FROM jobs_job").fetchall()}
        transitions = conn.execute("SELECT id, job_id, kind, state, history FROM jobs_transition").fetchall()
    return {"gpus": gpus, "nodes": nodes, "jobs": jobs, "transitions": transitions}


def test_two_workers_racing_on_starts_reports_a_resize_and_a_node_loss_leave_the_database_consistent(
        two_workers) -> None:
    stack = two_workers
    names = [f"race-{n}" for n in range(1, NODES + 1)]
    keys = {name: key_of_token(stack.post("api/agent-tokens", {"node": name})["token"]) for name in names}
    beats = Heartbeats(stack.state["redis_url"], keys, GPUS)
    beats.beat_all_once()
    beats.thread.start()
    app = Celery("simulated-ranks", broker=stack.state["redis_url"])
    app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True)
    try:
        wait_for(lambda: stack.get("api/health", token=True)["agents"]["healthy"] == NODES, timeout=60, interval=0.5)

        # Four starts at once (one node each).
        with ThreadPoolExecutor(4) as pool:
            jobs = list(pool.map(lambda n: stack.post("api/jobs", {
                "name": f"race-job-{n}", "model": "tiny-gpt", "layout": "dp=2", "global_batch": 8,
                "checkpoint_interval": 0}), range(4)))
        held = [(slot["node"], slot["gpu"]) for job in jobs for slot in job["placement"]]
        assert len(held) == len(set(held)) == 8, held  # no GPU given twice
        for job in jobs:
            for rank, slot in enumerate(job["placement"]):
                beats.jobs.setdefault(slot["node"], {}).setdefault(job["id"], []).append(rank)
        ranks = RankZeros(app, {job["id"]: job["placement"][0]["node"] for job in jobs}, keys, window=0.0)
        for job in jobs:
            ranks(job["id"], "started", step=0)
        wait_for(lambda: all(stack.get(f"api/jobs/{job['id']}", token=True)["state"] == "running" for job in jobs),
                 timeout=60, interval=0.5)

        # Steps of every job, one batch each, while job 0 grows and job 1's node falls silent.
        grown, lost = jobs[0], jobs[1]
        sending = threading.Thread(target=send_steps, args=(ranks, jobs), daemon=True)
        sending.start()
        transition = stack.post(f"api/jobs/{grown['id']}/resize", {"gpus": 4})
        for slot in transition["destination_placement"][2:]:
            beats.jobs.setdefault(slot["node"], {}).setdefault(grown["id"], []).append(slot["rank"])
        rank_zero = grown["placement"][0]["node"]
        for state in ("preparing", "ready", "transferring", "committed"):
            report = protocol.TransitionReport(
                job_id=grown["id"], transition_id=transition["id"], node=rank_zero, state=state, step=5,
                verified=True if state == "committed" else None, sent_at=datetime.now(timezone.utc))
            body = report.model_dump(mode="json")
            for _ in range(2):  # (a redelivery: both processes may take the two copies)
                app.send_task(protocol.CONTROL_TRANSITION_REPORT, args=[body], queue=protocol.CONTROL_QUEUE,
                              kwargs={"seal": seal(keys[rank_zero], rank_zero, protocol.CONTROL_TRANSITION_REPORT,
                                                   body)})
        lost_node = lost["placement"][0]["node"]
        beats.silence(lost_node)
        sending.join(timeout=60)
        ranks.close()

        wait_for(lambda: stack.get(f"api/transitions/{transition['id']}", token=True)["state"] == "committed",
                 timeout=60, interval=0.5)
        wait_for(lambda: database(stack)["nodes"][lost_node] == "lost", timeout=60, interval=0.5)
        wait_for(lambda: stack.get(f"api/jobs/{lost['id']}", token=True)["state"] not in LIVE, timeout=60, interval=0.5)
        running = [job for job in jobs if job is not lost]
        wait_for(lambda: all(stack.get(f"api/jobs/{job['id']}", token=True)["step"] == STEPS for job in running),
                 timeout=90, interval=0.5)
    finally:
        beats.stop.set()

    # GPUs held by exactly the jobs that run, on exactly their placements.
    rows = database(stack)
    live = {job_id: job for job_id, job in rows["jobs"].items() if job["state"] in LIVE}
    assert set(live) == {job["id"] for job in running}
    should = {(slot["node"], slot["gpu"]): job_id for job_id, job in live.items() for slot in job["placement"]}
    holds = {(node, index): job_id for node, index, _, job_id in rows["gpus"] if job_id is not None}
    assert holds == should
    for node, index, state, job_id in rows["gpus"]:
        expected = "lost" if rows["nodes"][node] == "lost" else ("allocated" if job_id is not None else "free")
        assert state == expected, (node, index, state, job_id)
    assert len(rows["jobs"][grown["id"]]["placement"]) == 4

    # Every transition settled, each state entered once.
    for transition_id, job_id, kind, state, history in rows["transitions"]:
        entered = [entry["state"] for entry in (history if isinstance(history, list) else json.loads(history))]
        assert state in TERMINAL, (transition_id, kind, state)
        assert len(entered) == len(set(entered)) and entered[-1] == state, (transition_id, entered)
        assert sum(s in TERMINAL for s in entered) == 1, (transition_id, entered)

    # Every step recorded once, in order (the job that lost its node: up to where it was lost).
    for job in jobs:
        steps = stack.get(f"api/jobs/{job['id']}/live", token=True)["metrics"]["loss"]["x"]
        if job is lost:
            assert steps == list(range(1, len(steps) + 1)), steps
        else:
            assert steps == list(range(1, STEPS + 1)), (job["id"], steps)

    # Both processes took reports.
    for log in ("worker.log", "worker-2.log"):
        text = (stack.var_dir / "logs" / log).read_text(errors="replace")
        assert "control.ingest_events" in text and "succeeded" in text, log


def send_steps(ranks: RankZeros, jobs: list[dict]) -> None:
    """Every job's steps 1..STEPS, interleaved across jobs, each its own batch (window 0)."""
    for step in range(1, STEPS + 1):
        for job in jobs:
            ranks(job["id"], "step", step=step, loss=1.0 / step, step_seconds=0.1, tokens_per_second=1000.0)
