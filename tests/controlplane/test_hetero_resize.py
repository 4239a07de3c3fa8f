"""Resizing a multimodal job (tiny-vlm) to and from heterogeneous layouts (issue 8):
POST /api/jobs/{id}/resize {"layout": "encoder:...;llm:..."} plans the per-module switch,
and layouts the heterogeneous trainer cannot run or the batch cannot be split for are
refused (400) with the rule, before anything moves. Real database and Redis; only the
Celery send_task is recorded (no agent runs here)."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest

from agents import protocol
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.tasks import transition_report
from tests.controlplane.test_jobs_resize import running_job

pytestmark = pytest.mark.django_db

NON_COLOCATED = "encoder:dp=2,ranks=0-1;llm:tp=2,ranks=2-3"
COLOCATED = "encoder:dp=4;llm:tp=2,dp=2"


def _running_vlm(run, token_client) -> Job:
    return running_job(run, token_client, name="vlm", model="tiny-vlm", layout="dp=2")


def _resize(run, token_client, job: Job, layout: str):
    return run(token_client.post, f"/api/jobs/{job.pk}/resize", {"layout": layout}, format="json")


def _commit(run, transition_id: int) -> None:
    t = Transition.objects.get(pk=transition_id)
    report = protocol.TransitionReport(
        job_id=t.job_id, transition_id=t.pk, node="node-1", state="committed", sent_at=datetime.now(timezone.utc),
        step=3, pause_seconds=0.5, transfer_seconds=0.3, verify_seconds=0.1, network_bytes=1, rounds=1,
        peak_bytes=1, predicted_peak_bytes=1, fingerprint=t.plan_fingerprint, verified=True)
    run(transition_report, report.model_dump(mode="json"))


def test_homogeneous_to_non_colocated_to_colocated(two_nodes, token_client, sent_tasks, run) -> None:
    job = _running_vlm(run, token_client)
    sent_tasks.clear()
    response = _resize(run, token_client, job, NON_COLOCATED)
    assert response.status_code == 202, response.content
    body = response.json()
    assert (body["source_layout"], body["destination_layout"]) == ("dp=2", NON_COLOCATED)
    assert (body["source_world"], body["destination_world"]) == (2, 4)
    # The plan moves the encoder's state onto ranks 0-1 and the LLM's onto 2-3 (new GPUs).
    assert body["plan_summary"]["network_bytes"] > 0 and body["plan_summary"]["world_dst"] == 4
    orders = [protocol.JobSwitchOrder.model_validate(m) for n, m, _ in sent_tasks if n == protocol.NODE_JOB_SWITCH]
    assert orders and {(o.src_layout, o.layout, o.world) for o in orders} == {("dp=2", NON_COLOCATED, 4)}
    _commit(run, body["id"])
    job.refresh_from_db()
    assert (job.state, job.layout, job.world_size) == ("running", NON_COLOCATED, 4)

    response = _resize(run, token_client, job, COLOCATED)  # both modules back on every rank
    assert response.status_code == 202, response.content
    assert (response.json()["source_layout"], response.json()["destination_layout"]) == (NON_COLOCATED, COLOCATED)


@pytest.mark.parametrize("layout,field,message", [
    ("encoder:pp=2;llm:pp=2", "layout", "encoder: pp=2; the encoder runs unpipelined"),
    # cp splits the LLM's image + text sequence (trained: test_hetero_context_parallel.py), never the encoder's
    ("encoder:dp=2,cp=2;llm:dp=2,cp=2", "layout", "encoder: cp=2; the encoder attends over each image's tokens whole"),
    ("encoder:dp=1,cp=2;llm:dp=2", "layout", "encoder: cp=2; the encoder attends over each image's tokens whole"),
    ("encoder:dp=2;llm:dp=4", "layout", "colocated modules must span the same number of ranks"),
    ("vision:dp=2;llm:dp=2", "layout", "has modules"),
    # the batch is cut over the LLM's dp (the encoder's dp=1 divides anything)
    ("encoder:dp=1,ranks=0-0;llm:dp=5,ranks=1-5", "global_batch", "not a multiple of micro_batch=1 x dp=5"),
])
def test_layouts_the_trainer_cannot_run_are_refused_with_the_rule(two_nodes, token_client, sent_tasks, run, layout,
                                                                  field, message) -> None:
    job = _running_vlm(run, token_client)
    sent_tasks.clear()
    response = _resize(run, token_client, job, layout)
    assert response.status_code == 400, response.content
    assert message in " ".join(response.json()[field]), response.json()
    job.refresh_from_db()
    assert (job.state, job.layout) == ("running", "dp=2")  # nothing moved
    assert not Transition.objects.filter(job=job).exists() and not sent_tasks


def test_a_multimodal_job_the_trainer_cannot_run_is_refused_at_creation(token_client, run) -> None:
    response = run(token_client.post, "/api/jobs", {"name": "vlm", "model": "tiny-vlm", "layout": "encoder:pp=2;llm:pp=2"},
                   format="json")
    assert response.status_code == 400
    assert "encoder: pp=2" in " ".join(response.json()["layout"])
