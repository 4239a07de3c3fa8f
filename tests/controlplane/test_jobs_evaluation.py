"""A job's validation loss (issue 42): `eval_every` and `eval_batches` in POST /api/jobs and
/api/jobs/validate, refused with a 400 naming `eval_every` without a dataset, on a dataset without
a validation split, or one whose split holds fewer samples than eval_batches global batches;
stored and shown; carried by every order that starts ranks (start, restore, the ranks of a switch)
into the agents' JobSettings; rank 0's `validation_loss` kept as a `validation_loss` series beside
`loss` in GET /api/jobs/{id}/live and its websocket events, under the same rules as loss (a step
retrained after a restore appends again, as loss does).

Real PostgreSQL (or SQLite) and real dataset directories; only the control plane's Celery
send_task is replaced by a recorder (no agent runs here)."""
from __future__ import annotations


import pytest

from agents import protocol
from agents.runtime.job_settings import JobSettings
from parallelism.training.loop import evaluation_due
from parallelism.datasets.dataset import TokenDataset
from controlplane.jobs import restore
from controlplane.jobs.events import JobLiveSnapshot, MetricsEvent, apply_job_event, job_event_adapter
from controlplane.jobs.ingest import Outcome, batch_ingest
from controlplane.jobs.models import Job
from controlplane.jobs.reports import job_record_report
from controlplane.jobs.selectors import job_live_snapshot
from tests.controlplane.conftest import embedded_json
from tests.controlplane.test_datasets import no_server_path
from tests.controlplane.test_jobs_restore import lose_node, sent_of, trained_to
from tests.support.datasets import TEXTS, text_dataset
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def code(data_root, token_client) -> dict:
    """A registered byte-level dataset with a validation split (12 documents, a quarter held out)."""
    text_dataset(data_root / "code", texts=TEXTS * 3, validation_fraction=0.25)
    response = token_client.post("/api/datasets", {"path": "code"}, format="json")
    assert response.status_code == 201 and response.json()["validation_documents"] == 3, response.content
    return response.json()


def job_body(**fields) -> dict:
    return {"name": "j", "model": "tiny-gpt", "gpus": 2, "global_batch": 8, "seq_len": 16, "dataset": "code",
            **fields}


def test_eval_settings_are_checked_stored_and_shown(token_client, two_nodes, code, data_root, run) -> None:
    held = TokenDataset(data_root / "code", 16, split="validation").samples_per_epoch
    assert held >= 8, held
    checked = token_client.post("/api/jobs/validate", job_body(eval_every=5, eval_batches=1), format="json")
    assert checked.status_code == 200, checked.content
    assert {k: checked.json()[k] for k in ("eval_every", "eval_batches", "validation_samples")} == {
        "eval_every": 5, "eval_batches": 1, "validation_samples": held}
    plain = token_client.post("/api/jobs/validate", job_body(), format="json").json()
    assert (plain["eval_every"], plain["eval_batches"], plain["validation_samples"]) == (0, 4, None)
    created = run(token_client.post, "/api/jobs", job_body(eval_every=5, eval_batches=1, start=False), format="json")
    assert created.status_code == 201, created.content
    job = token_client.get(f"/api/jobs/{created.json()['id']}").json()
    assert (job["eval_every"], job["eval_batches"]) == (5, 1)
    row = Job.objects.get(pk=job["id"])
    assert (row.eval_every, row.eval_batches) == (5, 1)


@pytest.mark.parametrize("changes,words", [
    ({"dataset": None}, ["eval_every=5 evaluates the loss on a dataset's validation split", "give `dataset`"]),
    ({"dataset": "flat"}, ["dataset 'flat' has no validation split (validation_fraction 0)"]),
    ({"eval_batches": 1000}, ["fewer than eval_batches=1000 x global_batch=8", "lower eval_batches (at most"]),
    ({"global_batch": 4096, "micro_batch": 2048, "eval_batches": 1},
     ["fewer than eval_batches=1 x global_batch=4096", "less than one global batch"]),
])
def test_an_evaluation_the_data_cannot_hold_is_refused_naming_eval_every(token_client, two_nodes, code, data_root,
                                                                         tmp_path, changes, words) -> None:
    text_dataset(data_root / "flat", validation_fraction=0.0)
    assert token_client.post("/api/datasets", {"path": "flat"}, format="json").status_code == 201
    for url in ("/api/jobs/validate", "/api/jobs"):
        response = token_client.post(url, job_body(eval_every=5, **changes), format="json")
        assert response.status_code == 400, response.content
        assert list(response.json()) == ["eval_every"], response.json()
        for word in words:
            assert word in response.json()["eval_every"][0], response.json()
        no_server_path(response, tmp_path)
    assert not Job.objects.exists()


@pytest.mark.parametrize("changes,field", [({"eval_every": -1}, "eval_every"), ({"eval_batches": 0}, "eval_batches"),
                                           ({"eval_batches": 1001}, "eval_batches"),
                                           ({"eval_every": "often"}, "eval_every")])
def test_eval_fields_out_of_range_are_400s_naming_them(token_client, two_nodes, code, changes, field) -> None:
    response = token_client.post("/api/jobs/validate", job_body(**changes), format="json")
    assert response.status_code == 400 and list(response.json()) == [field], response.content


def test_every_order_that_starts_ranks_carries_the_eval_settings(token_client, two_nodes, code, sent_tasks,
                                                                 run) -> None:
    response = run(token_client.post, "/api/jobs", job_body(gpus=2, eval_every=3, eval_batches=2,
                                                             checkpoint_interval=10), format="json")
    job = Job.objects.get(pk=response.json()["id"])
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    start = protocol.JobStartOrder.model_validate(message)
    assert (start.eval_every, start.eval_batches) == (3, 2)
    settings = JobSettings.of(start)
    assert (settings.eval_every, settings.eval_batches) == (3, 2)
    assert evaluation_due(settings.validation_every, 6) and not evaluation_due(settings.validation_every, 7)
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    sent_tasks.clear()
    assert run(token_client.post, f"/api/jobs/{job.pk}/resize", {"gpus": 4}, format="json").status_code == 202
    switches = [protocol.JobSwitchOrder.model_validate(m) for m, _ in sent_of(sent_tasks, protocol.NODE_JOB_SWITCH)]
    assert len(switches) == 2 and {(o.eval_every, o.eval_batches) for o in switches} == {(3, 2)}
    assert JobSettings.of(switches[0]).eval_every == 3


def test_a_restore_keeps_the_eval_settings(token_client, two_nodes, code, sent_tasks, run) -> None:
    response = run(token_client.post, "/api/jobs", job_body(gpus=4, eval_every=3, checkpoint_interval=10),
                   format="json")
    job = Job.objects.get(pk=response.json()["id"])
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    trained_to(run, job, 14, 10)
    assert lose_node(run, "node-2", keep="node-1") == ["node-2"]
    sent_tasks.clear()
    run(restore.job_restore, job_id=job.pk)
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    order = protocol.JobStartOrder.model_validate(message)
    assert (order.restore_from, order.eval_every, order.eval_batches) == ("/ckpt/step-00000010", 3, 4)


def test_validation_loss_is_a_series_beside_loss_live_and_in_events(token_client, two_nodes, code, sent_events,
                                                                    run) -> None:
    job = run(token_client.post, "/api/jobs", job_body(eval_every=2), format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    before = JobLiveSnapshot.model_validate(token_client.get(f"/api/jobs/{job['id']}/live").json())
    sent_events.clear()
    for step in range(1, 6):
        run(job_record_report, report=report_of(job["id"], "step", "node-1", step=step, loss=5.0 - step / 10,
                                                validation_loss=(6.0 - step / 10) if step % 2 == 0 else None))
    live = token_client.get(f"/api/jobs/{job['id']}/live").json()
    assert live["metrics"]["validation_loss"] == {"x": [2.0, 4.0], "y": [5.8, 5.6]}
    assert live["metrics"]["loss"]["x"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    events = [e for e in sent_events if isinstance(e, MetricsEvent)]
    assert [e.validation_loss for e in events] == [None, 5.8, None, 5.6, None]
    # snapshot + events == later snapshot, through the wire format the page reads
    for event in events:
        before = apply_job_event(before, job_event_adapter.validate_json(event.model_dump_json()))
    assert before == job_live_snapshot(job_id=job["id"])


def test_batched_reports_and_a_retrained_step_keep_validation_loss_as_loss(token_client, two_nodes, code,
                                                                           run) -> None:
    """Through rank 0's batches (ingest.py), and after a restore from the checkpoint of step 2 the
    retrained steps append again, loss and validation loss alike (the live chart shows both runs)."""
    job = run(token_client.post, "/api/jobs", job_body(eval_every=2, checkpoint_interval=2), format="json").json()

    def batch(n: int, *reports) -> protocol.ReportBatch:
        return protocol.ReportBatch(job_id=job["id"], node="node-1", stream="s1", batch=n, reports=reports)

    steps = [report_of(job["id"], "step", "node-1", step=s, loss=4.0 - s, validation_loss=4.5 - s if s % 2 == 0
                       else None) for s in (1, 2, 3)]
    assert run(batch_ingest, batch=batch(1, report_of(job["id"], "started", "node-1"), *steps)) is Outcome.APPLIED
    retrained = [report_of(job["id"], "step", "node-1", step=s, loss=4.1 - s, validation_loss=4.6 - s if s % 2 == 0
                           else None) for s in (3, 4)]
    assert run(batch_ingest, batch=batch(2, *retrained)) is Outcome.APPLIED
    metrics = token_client.get(f"/api/jobs/{job['id']}/live").json()["metrics"]
    assert metrics["loss"]["x"] == [1.0, 2.0, 3.0, 3.0, 4.0]
    assert metrics["validation_loss"] == {"x": [2.0, 4.0], "y": [2.5, pytest.approx(0.6)]}


def test_the_job_page_draws_validation_on_the_loss_chart(browser_client, token_client, two_nodes, code,
                                                         run) -> None:
    job = run(token_client.post, "/api/jobs", job_body(eval_every=2, eval_batches=1), format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    for step in (1, 2):
        run(job_record_report, report=report_of(job["id"], "step", "node-1", step=step, loss=3.0,
                                                validation_loss=3.5 if step == 2 else None))
    html = browser_client.get(f"/jobs/{job['id']}/").content.decode()
    figures = embedded_json(html, "job-figures")
    assert sorted(figures) == ["loss", "step_seconds", "tokens_per_second"]
    (training, validation) = figures["loss"]["data"]
    assert (validation["name"], validation["x"], validation["y"]) == ("validation", [2.0], [3.5])
    assert figures["loss"]["layout"]["showlegend"] is True and len(figures["step_seconds"]["data"]) == 1
    assert "validation loss every 2 steps (1 batch)" in html
    data = embedded_json(html, "job-data")
    assert (data["eval_every"], data["eval_batches"], data["init_from"]) == (2, 1, "")
