"""A job's dataset (issue 42): named by name or id in POST /api/jobs and /api/jobs/validate,
refused with a 400 naming `dataset` when the model cannot train on it (its vocab is larger, it has
no sample of the job's seq, a multimodal model); every order that starts ranks (start, the joining
ranks of a resize, a restore) carries its absolute directory, and the agents' JobSettings pass it
to the trainer's TrainConfig; the job API shows the dataset and the data read so far.

Real PostgreSQL (or SQLite), real dataset directories (the library's prepare and IndexedWriter);
only the control plane's Celery send_task is replaced, by a recorder, since no agent runs here."""
from __future__ import annotations

import json

import pytest

from agents import protocol
from agents.runtime.job_settings import JobSettings
from parallelism.datasets.describe import describe
from controlplane.jobs import restore
from controlplane.jobs.models import Job
from controlplane.jobs.reports import job_record_report
from controlplane.jobs.selectors import data_progress
from tests.controlplane.test_datasets import no_server_path
from tests.controlplane.test_jobs_restore import lose_node, sent_of, trained_to
from tests.support.datasets import text_dataset, token_dataset
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db


@pytest.fixture
def code(data_root, token_client) -> dict:
    """A registered byte-level dataset ("code", vocab 257: tiny-gpt has 512 rows)."""
    text_dataset(data_root / "code", validation_fraction=0.25)
    response = token_client.post("/api/datasets", {"path": "code"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def job_body(**fields) -> dict:
    return {"name": "j", "model": "tiny-gpt", "gpus": 2, "global_batch": 8, "seq_len": 16, **fields}


def test_a_job_names_its_dataset_by_name_or_id(token_client, two_nodes, code, data_root, run) -> None:
    checked = token_client.post("/api/jobs/validate", job_body(dataset="code"), format="json")
    assert checked.status_code == 200, checked.content
    per_epoch = describe(data_root / "code", 16)["samples_per_epoch"]
    assert (checked.json()["dataset"], checked.json()["samples_per_epoch"]) == ("code", per_epoch) and per_epoch > 1
    plain = token_client.post("/api/jobs/validate", job_body(), format="json").json()
    assert (plain["dataset"], plain["samples_per_epoch"]) == (None, None)
    created = run(token_client.post, "/api/jobs", job_body(dataset=code["id"], start=False), format="json")
    assert created.status_code == 201, created.content
    job = created.json()
    assert job["dataset"] == {"id": code["id"], "name": "code"}
    assert job["data_progress"] == {"samples": 0, "tokens": 0, "epoch": 0.0, "samples_per_epoch": per_epoch}
    assert token_client.get(f"/api/jobs/{job['id']}").json()["dataset"] == {"id": code["id"], "name": "code"}
    other = run(token_client.post, "/api/jobs", job_body(name="k", dataset=str(code["id"]), start=False),
                format="json")
    assert other.json()["dataset"]["name"] == "code"
    synthetic = run(token_client.post, "/api/jobs", job_body(name="s", dataset="", start=False), format="json")
    assert synthetic.json()["dataset"] is None and synthetic.json()["data_progress"]["epoch"] is None
    assert token_client.get(f"/api/datasets/{code['id']}").json()["jobs"] == [
        {"id": job["id"], "name": "j"}, {"id": other.json()["id"], "name": "k"}]


def test_data_progress_is_step_times_batch_and_epochs_of_the_job_s_seq(token_client, two_nodes, code,
                                                                       run) -> None:
    job = run(token_client.post, "/api/jobs", job_body(dataset="code", global_batch=12), format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    run(job_record_report, report=report_of(job["id"], "step", "node-1", step=25, loss=3.0))
    row = Job.objects.get(pk=job["id"])
    per_epoch = row.dataset_samples_per_epoch
    progress = token_client.get(f"/api/jobs/{job['id']}").json()["data_progress"]
    assert progress == {"samples": 300, "tokens": 300 * 16, "epoch": pytest.approx(300 / per_epoch),
                        "samples_per_epoch": per_epoch}
    assert data_progress(step=None, global_batch=8, seq_len=4, samples_per_epoch=None) == {
        "samples": 0, "tokens": 0, "epoch": None, "samples_per_epoch": None}
    assert data_progress(step=3, global_batch=8, seq_len=4, samples_per_epoch=16)["epoch"] == 1.5


def test_a_vocab_larger_than_the_model_s_is_refused_naming_dataset(token_client, two_nodes, data_root, tmp_path,
                                                                  run) -> None:
    token_dataset(data_root / "wide", [[1, 2, 3, 4, 5]] * 40, vocab_size=50_000)
    assert token_client.post("/api/datasets", {"path": "wide"}, format="json").status_code == 201
    for url in ("/api/jobs/validate", "/api/jobs"):
        response = run(token_client.post, url, job_body(dataset="wide"), format="json")
        assert response.status_code == 400, response.content
        assert response.json() == {"dataset": [
            "dataset 'wide' has a vocab of 50,000 tokens, more than the 512 of tiny-gpt: token ids past 511 have no "
            "embedding row"]}
        no_server_path(response, tmp_path)
    assert not Job.objects.exists()


def test_a_dataset_without_one_sample_of_the_job_s_seq_is_refused(token_client, two_nodes, data_root, tmp_path,
                                                                  run) -> None:
    token_dataset(data_root / "tiny", [[1, 2, 3], [4, 5, 6, 7]], vocab_size=300)
    assert token_client.post("/api/datasets", {"path": "tiny"}, format="json").status_code == 201
    response = token_client.post("/api/jobs/validate", job_body(dataset="tiny", seq_len=8), format="json")
    assert response.status_code == 400 and list(response.json()) == ["dataset"], response.content
    assert "fewer than one sample of seq 8 + 1" in response.json()["dataset"][0]
    no_server_path(response, tmp_path)
    assert token_client.post("/api/jobs/validate", job_body(dataset="tiny", seq_len=4), format="json").status_code \
        == 200


def test_an_unknown_or_changed_dataset_is_refused(token_client, two_nodes, code, data_root, tmp_path) -> None:
    for value in ("nope", "99999", 99999, "lone\ud800", "../code", "x" * 63):
        response = token_client.post("/api/jobs/validate", json.dumps(job_body(dataset=value)),
                                     content_type="application/json")
        message = response.json()["dataset"][0]
        assert response.status_code == 400 and ("is registered" in message or "Surrogate" in message), message
    text_dataset(data_root / "code", texts=["something else entirely\n" * 30] * 3, validation_fraction=0.25)
    response = token_client.post("/api/jobs/validate", job_body(dataset="code"), format="json")
    assert response.status_code == 400 and "holds other data than when it was registered" in \
        response.json()["dataset"][0], response.content
    no_server_path(response, tmp_path)


def test_every_order_that_starts_ranks_carries_the_dataset_directory(token_client, two_nodes, code, data_root,
                                                                     sent_tasks, run) -> None:
    directory = str(data_root / "code")
    job = run(token_client.post, "/api/jobs", job_body(gpus=2, dataset="code", checkpoint_interval=10),
              format="json").json()
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    start = protocol.JobStartOrder.model_validate(message)
    assert start.dataset == directory
    settings = JobSettings.of(start)
    assert settings.dataset == directory
    config = settings.config(start.layout)
    assert (config.dataset, config.seq_len, config.global_batch) == (directory, 16, 8)
    # A resize: every involved node's switch order carries it (joining ranks read it from there).
    row = Job.objects.get(pk=job["id"])
    run(job_record_report, report=report_of(row.pk, "started", "node-1"))
    sent_tasks.clear()
    response = run(token_client.post, f"/api/jobs/{row.pk}/resize", {"gpus": 4}, format="json")
    assert response.status_code == 202, response.content
    switches = [protocol.JobSwitchOrder.model_validate(m) for m, _ in sent_of(sent_tasks, protocol.NODE_JOB_SWITCH)]
    assert len(switches) == 2 and {o.dataset for o in switches} == {directory}
    assert JobSettings.of(switches[0]).config("dp=4").dataset == directory


def test_a_restored_job_keeps_its_dataset(token_client, two_nodes, code, data_root, sent_tasks, run) -> None:
    response = run(token_client.post, "/api/jobs", job_body(gpus=4, dataset="code", checkpoint_interval=10),
                   format="json")
    job = Job.objects.get(pk=response.json()["id"])
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    trained_to(run, job, 14, 10)
    assert lose_node(run, "node-2", keep="node-1") == ["node-2"]
    sent_tasks.clear()
    run(restore.job_restore, job_id=job.pk)
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    order = protocol.JobStartOrder.model_validate(message)
    assert (order.restore_from, order.dataset) == ("/ckpt/step-00000010", str(data_root / "code"))


def test_a_synthetic_job_s_orders_name_no_dataset(token_client, two_nodes, sent_tasks, run) -> None:
    run(token_client.post, "/api/jobs", job_body(), format="json")
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    order = protocol.JobStartOrder.model_validate(message)
    assert order.dataset == "" and JobSettings.of(order).config(order.layout).dataset is None
