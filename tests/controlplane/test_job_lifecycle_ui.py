"""Issue 28's lifecycle on the pages, server side: POST /api/jobs/validate answers what
POST /api/jobs would (the New job form's checks, nothing created); POST /api/models stores
an uploaded config.json, bounded; the pages embed what their controls need (the action
states from the lifecycle, no ranks for a job that holds no GPUs); the demo job's bootstrap."""
from __future__ import annotations

import io
import json
import os

import pytest
from django.core.management import call_command
from django.test import Client

from tests.support.reports import report_of
from controlplane.common.model_store import MAX_CONFIG_BYTES
from controlplane.jobs.models import Job
from controlplane.jobs.reports import job_record_report
from tests.controlplane.conftest import embedded_json
from tests.controlplane.test_hostile_input import SERVER_PATHS, assert_400

pytestmark = pytest.mark.django_db

TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": False}


@pytest.fixture
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path / "models"






# --- POST /api/jobs/validate ----------------------------------------------------------------

def test_validate_answers_the_job_it_would_create_and_creates_nothing(token_client, two_nodes, sent_events) -> None:
    body = {"name": "v", "model": "tiny-gpt", "gpus": 2, "global_batch": 12, "seq_len": 16}
    response = token_client.post("/api/jobs/validate", body, format="json")
    assert response.status_code == 200, response.content
    assert response.json() == {"name": "v", "model": "tiny-gpt", "layout": "dp=2", "world_size": 2, "global_batch": 12,
                               "micro_batch": 1, "seq_len": 16, "max_steps": None, "checkpoint_interval": 100,
                               "elastic": False, "min_gpus": None, "max_gpus": None, "priority": 0,
                               "dataset": None, "samples_per_epoch": None, "eval_every": 0, "eval_batches": 4,
                               "validation_samples": None, "init_from": ""}
    assert not Job.objects.exists() and sent_events == []


@pytest.mark.parametrize("body, field", [
    ({"global_batch": 7}, "global_batch"),  # not a multiple of micro_batch x dp
    ({"model": "no-such-model"}, "model"),
    ({"model": "../etc/passwd"}, "model"),
    ({"gpus": 5}, "gpus"),  # more than the cluster's 4
    ({"layout": "tp=3", "gpus": None}, "layout"),
    ({"seq_len": "many"}, "seq_len"),
    ({"checkpoint_interval": -1}, "checkpoint_interval"),
    ({"name": "bad name!"}, "name"),
    ({"model": "gpt3-175b", "gpus": 1}, "gpus"),  # does not fit the GPU
])
def test_validate_refuses_with_the_body_create_answers(token_client, two_nodes, body, field) -> None:
    sent = {"name": "v", "model": "tiny-gpt", "gpus": 2, "global_batch": 12, **body}
    sent = {k: v for k, v in sent.items() if v is not None}
    checked = token_client.post("/api/jobs/validate", sent, format="json")
    created = token_client.post("/api/jobs", {**sent, "start": False}, format="json")
    assert_400(checked, field)
    assert checked.json() == created.json()  # the same rules, the same words
    assert not Job.objects.exists()


def test_validate_knows_taken_names_and_needs_a_signed_in_user(token_client, two_nodes) -> None:
    body = {"name": "taken", "model": "tiny-gpt", "gpus": 2, "global_batch": 12, "start": False}
    assert token_client.post("/api/jobs", body, format="json").status_code == 201
    assert_400(token_client.post("/api/jobs/validate", body, format="json"), "name", "already exists")
    assert Client().post("/api/jobs/validate", body, content_type="application/json").status_code in (401, 403)


# --- /api/models --------------------------------------------------------------------------

def test_models_lists_the_catalog_and_uploads_become_models_jobs_name(token_client, two_nodes, models_dir) -> None:
    listed = token_client.get("/api/models").json()
    assert {"name": "tiny-gpt", "source": "catalog"}.items() <= listed[0].items()
    response = token_client.post("/api/models", {"name": "tiny-llama", "config": TINY_LLAMA}, format="json")
    assert response.status_code == 201, response.content
    stored = response.json()
    assert (stored["source"], stored["family"], stored["heads"], stored["kv_heads"]) == ("stored", "llama", 4, 2)
    assert json.loads((models_dir / "tiny-llama" / "config.json").read_text()) == TINY_LLAMA
    assert [m["name"] for m in token_client.get("/api/models").json()][-1] == "tiny-llama"
    assert not [p for p in os.listdir(models_dir) if p.startswith(".")]  # no temporary folder left
    job = token_client.post("/api/jobs", {"name": "on-upload", "model": "tiny-llama", "gpus": 2, "start": False},
                            format="json")
    assert job.status_code == 201 and job.json()["model"] == "tiny-llama"
    for path in SERVER_PATHS:
        assert path not in json.dumps(stored)


@pytest.mark.parametrize("body, field, words", [
    ({"name": "../escape"}, "name", "not a model name"),
    ({"name": "/etc/x"}, "name", "not a model name"),
    ({"name": "a/b"}, "name", "not a model name"),
    ({"name": "tiny-gpt"}, "name", "catalog model"),
    ({"config": {"model_type": "bert"}}, "config", "unsupported model_type"),
    ({"config": {"model_type": "llama"}}, "config", "missing key"),
    ({"config": [1, 2]}, "config", ""),
    ({"config": {**TINY_LLAMA, "num_hidden_layers": 10**9}}, "config", "more than 1024"),
    ({"config": {**TINY_LLAMA, "pad": "x" * MAX_CONFIG_BYTES}}, "config", "KiB"),
])
def test_an_upload_is_a_400_naming_the_field_and_the_rule(token_client, models_dir, body, field, words) -> None:
    response = token_client.post("/api/models", {"name": "up", "config": TINY_LLAMA, **body}, format="json")
    assert_400(response, field, words, sent=body.get("name", ""))
    assert not models_dir.exists() or os.listdir(models_dir) == []


def test_a_stored_model_is_never_replaced_and_big_bodies_are_refused_unread(token_client, models_dir) -> None:
    assert token_client.post("/api/models", {"name": "m", "config": TINY_LLAMA}, format="json").status_code == 201
    again = token_client.post("/api/models", {"name": "m", "config": {**TINY_LLAMA, "num_hidden_layers": 9}},
                              format="json")
    assert_400(again, "name", "stored already")
    assert json.loads((models_dir / "m" / "config.json").read_text())["num_hidden_layers"] == 2
    huge = json.dumps({"name": "big", "config": {"model_type": "llama", "x": "y" * (4 * MAX_CONFIG_BYTES)}})
    response = token_client.post("/api/models", huge, content_type="application/json")
    assert response.status_code == 413 and "KiB" in response.json()["detail"]
    assert Client().post("/api/models", {"name": "anon", "config": TINY_LLAMA},
                         content_type="application/json").status_code in (401, 403)


# --- the pages ----------------------------------------------------------------------------------

def test_jobs_page_has_the_new_job_form_with_a_free_name_and_the_models(browser_client, token_client, two_nodes,
                                                                      models_dir) -> None:
    token_client.post("/api/models", {"name": "tiny-llama", "config": TINY_LLAMA}, format="json")
    token_client.post("/api/jobs", {"name": "job-1", "model": "tiny-gpt", "gpus": 2, "start": False}, format="json")
    html = browser_client.get("/jobs/").content.decode()
    assert 'id="new-job-form"' in html and 'value="job-2"' in html  # job-1 is taken
    assert '<option value="tiny-gpt" selected>' in html and '<option value="tiny-llama">' in html
    assert [m["name"] for m in embedded_json(html, "model-stored")] == ["tiny-llama"]
    assert "Job gone deleted." in browser_client.get("/jobs/?deleted=gone").content.decode()


def test_job_page_embeds_its_action_states_and_draws_no_ranks_once_stopped(browser_client, token_client, two_nodes,
                                                                           run, sent_tasks) -> None:
    job = run(token_client.post, "/api/jobs", {"name": "s", "model": "tiny-gpt", "gpus": 2, "global_batch": 12},
              format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    html = browser_client.get(f"/jobs/{job['id']}/").content.decode()
    assert embedded_json(html, "action-states") == {
        "start": ["pending"], "stop": ["pending", "restoring", "running", "starting", "stopping", "switching"],
        "delete": ["failed", "pending", "stopped"], "resize": ["running"], "preview": ["running", "starting"]}
    assert len(embedded_json(html, "job-data")["ranks"]) == 2
    run(token_client.post, f"/api/jobs/{job['id']}/stop", {}, format="json")
    for node in ("node-1",):
        run(job_record_report, report=report_of(job["id"], "stopped", node))
    assert token_client.get(f"/api/jobs/{job['id']}").json()["state"] == "stopped"
    data = embedded_json(browser_client.get(f"/jobs/{job['id']}/").content.decode(), "job-data")
    assert data["state"] == "stopped" and data["ranks"] == [] and data["placement"]  # the row keeps its placement


# --- the demo job ------------------------------------------------------------------------------

def test_bootstrap_reports_the_demo_job_pending_for_the_launcher_to_start(settings, tmp_path) -> None:
    settings.VAR_DIR = tmp_path
    settings.DYNAPLANE_DATA_ROOT = str(tmp_path / "data")
    source = tmp_path / "source"  # (a stand-in for the standard library: tests/controlplane/test_demo_dataset.py)
    source.mkdir()
    (source / "a.py").write_text("print('hello')\n" * 200)
    out = io.StringIO()
    call_command("dynaplane_bootstrap", "--demo", "--demo-source", str(source), stdout=out)
    first = json.loads(out.getvalue())
    demo = Job.objects.get(name="demo")
    assert first["demo"] == {"id": demo.pk, "state": "pending"} and demo.layout == "tp=2"
    out = io.StringIO()
    call_command("dynaplane_bootstrap", "--demo", "--demo-source", str(source), stdout=out)
    assert json.loads(out.getvalue())["demo"] == first["demo"] and Job.objects.count() == 1
    out = io.StringIO()
    call_command("dynaplane_bootstrap", stdout=out)
    assert json.loads(out.getvalue())["demo"] is None
