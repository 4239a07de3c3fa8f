"""A job started from a checkpoint (`POST /api/jobs` with `resume_from`), control-plane
half: the checkpoint is checked, the start orders carry it (`restore_from`, `restore_id`),
a `restore` row records it and the ranks' `restored` report commits it.

Real PostgreSQL (or SQLite) and Redis; only the control plane's Celery send_task is
replaced, by a recorder, since no agent runs here. The checkpoint folders are real
complete.json files as agents/runtime/checkpoints.py writes them (no DCP payload: the
control plane reads only complete.json)."""
from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from agents import protocol
from tests.support.reports import report_of
from agents.runtime.checkpoints import COMPLETE, step_dir
from controlplane.jobs.models import Job
from controlplane.jobs.reports import job_record_report

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def checkpoint_root(settings, tmp_path):
    """The checkpoints these tests write lie under the checkpoint root, as every job's must."""
    settings.DYNAPLANE_CHECKPOINT_ROOT = str(tmp_path)


def _checkpoint(root, step: int, layout: str, model: str = "tiny-gpt") -> str:
    path = step_dir(root, step)
    path.mkdir(parents=True)
    (path / COMPLETE).write_text(json.dumps({"step": step, "layout": layout, "model": model, "digests": []}))
    return str(path)


def _post(run, client, **body):
    return run(client.post, "/api/jobs", {"name": "resumed", "model": "tiny-gpt", "global_batch": 12, **body},
               format="json")


def test_a_job_resumes_from_a_checkpoint_on_another_gpu_count(two_nodes, token_client, sent_tasks, run,
                                                             tmp_path) -> None:
    path = _checkpoint(tmp_path, 30, "dp=2")
    response = _post(run, token_client, gpus=4, resume_from=path, max_steps=40)
    assert response.status_code == 201, response.content
    body = response.json()
    assert (body["state"], body["layout"], body["checkpoint_step"], body["checkpoint_path"]) == (
        "starting", "dp=4", 30, path)
    job = Job.objects.get(pk=body["id"])
    orders = [protocol.JobStartOrder.model_validate(m) for t, m, _ in sent_tasks if t == protocol.NODE_JOB_START]
    assert len(orders) == 2 and {(o.restore_from, o.restore_id, o.world) for o in orders} == {
        (path, job.restore_id, 4)}
    (row,) = job.transitions.all()
    assert (row.kind, row.state, row.source_layout, row.destination_layout, row.step, row.pk) == (
        "restore", "planned", "dp=2", "dp=4", 30, job.restore_id)
    assert row.reason == f"started from checkpoint {path} (step 30, written by dp=2) on 4 GPUs as dp=4"
    now = datetime.now(timezone.utc)
    run(job_record_report, report=protocol.job_report(job_id=job.pk, node="node-1", kind="restored", step=30,
                                                     checkpoint_path=str(path), verified=True, seconds=2.0, restore_id=row.pk, sent_at=now))
    run(job_record_report, report=report_of(job.pk, "step", step=31, loss=3.0, restore_id=row.pk))
    row.refresh_from_db()
    job.refresh_from_db()
    assert (row.state, row.verification["verified"], row.transfer_seconds) == ("committed", True, 2.0)
    assert (job.state, job.step) == ("running", 31)


def test_resume_from_is_checked(two_nodes, token_client, run, tmp_path) -> None:
    bad = _post(run, token_client, gpus=1, resume_from="/elsewhere/step-1")
    assert bad.status_code == 400 and "outside the checkpoint root" in bad.json()["resume_from"][0]
    bad = _post(run, token_client, gpus=1, resume_from="relative/step-1")  # taken from the root
    assert bad.status_code == 400 and bad.json()["resume_from"] == [
        f"{tmp_path / 'relative' / 'step-1'} is not a complete checkpoint (no complete.json)"]
    bad = _post(run, token_client, gpus=1, resume_from=str(tmp_path))
    assert bad.status_code == 400 and bad.json()["resume_from"] == [
        f"{tmp_path} is not a complete checkpoint (no complete.json)"]
    other = _checkpoint(tmp_path, 5, "dp=1", model="llama-124m")
    bad = _post(run, token_client, gpus=1, resume_from=other)
    assert bad.status_code == 400 and bad.json()["resume_from"] == [
        f"{other} is a checkpoint of model 'llama-124m', not of 'tiny-gpt'"]
    done = _checkpoint(tmp_path, 40, "dp=2")
    bad = _post(run, token_client, gpus=1, resume_from=done, max_steps=40)
    assert bad.status_code == 400 and bad.json()["max_steps"] == [
        "max_steps=40 is not after the checkpoint's step 40 (steps count from 0 across the resume)"]
    assert not Job.objects.exists()
