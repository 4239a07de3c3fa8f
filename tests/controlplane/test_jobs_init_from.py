"""A job's initial weights (issue 42): `init_from`, a Hugging Face model directory under the
weights root (DYNAPLANE_WEIGHTS_ROOT), in POST /api/jobs and /api/jobs/validate. Without `model`
the job trains the model its config.json describes (stored as a model, an equal stored config
reused); with one, the directory must hold that model (the first differing tensor named). Every
bad directory is a 400 naming `init_from` in the hf_weights library's words, paths relative to the
weights root; the first start's orders carry its absolute path, a restore's none.

Real PostgreSQL (or SQLite), real Hugging Face directories (a tiny Llama built with transformers,
saved in shards); only the control plane's Celery send_task is replaced by a recorder."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from agents import protocol
from controlplane.jobs import restore
from controlplane.jobs.models import Job
from controlplane.jobs.reports import job_record_report
from tests.controlplane.conftest import embedded_json
from tests.controlplane.test_datasets import no_server_path
from tests.controlplane.test_jobs_restore import lose_node, sent_of, trained_to
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A tiny Llama (vocab 128) saved by transformers in three safetensors shards with an index."""
    from tests.parallelism.hf_weights.tiny_hf import save_hf_model

    return Path(save_hf_model("llama", tmp_path_factory.mktemp("hf") / "llama", max_shard_size="20KB"))


@pytest.fixture
def weights_root(settings, tmp_path, monkeypatch, tiny_llama) -> Path:
    root = tmp_path / "weights"
    shutil.copytree(tiny_llama, root / "llama")
    settings.DYNAPLANE_WEIGHTS_ROOT = str(root)
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(tmp_path / "models"))
    return root


def job_body(**fields) -> dict:
    return {"name": "j", "gpus": 2, "global_batch": 8, "seq_len": 16, "init_from": "llama", **fields}


def refused(response, tmp_path: Path, *words: str) -> str:
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == ["init_from"], body
    for word in words:
        assert word in body["init_from"][0], body
    no_server_path(response, tmp_path)
    return body["init_from"][0]


def test_without_a_model_the_job_trains_the_directory_s_config(token_client, two_nodes, weights_root, tmp_path,
                                                               sent_tasks, run) -> None:
    checked = token_client.post("/api/jobs/validate", job_body(), format="json")
    assert checked.status_code == 200, checked.content
    assert (checked.json()["model"], checked.json()["init_from"]) == ("llama", "llama")
    assert not (tmp_path / "models").exists()  # validate stores nothing
    created = run(token_client.post, "/api/jobs", job_body(), format="json")
    assert created.status_code == 201, created.content
    job = created.json()
    assert (job["model"], job["init_from"]) == ("llama", "llama")
    stored = {m["name"]: m for m in token_client.get("/api/models").json()}["llama"]
    assert stored["source"] == "stored" and stored["vocab"] == 128 and stored["error"] == ""
    assert json.loads((tmp_path / "models" / "llama" / "config.json").read_text()) == json.loads(
        (weights_root / "llama" / "config.json").read_text())
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    order = protocol.JobStartOrder.model_validate(message)
    assert (order.model, order.init_from, order.restore_from) == ("llama", str(weights_root / "llama"), "")
    # A second job from the same directory trains the same stored model; an absolute path inside works too.
    again = run(token_client.post, "/api/jobs", job_body(name="k", init_from=str(weights_root / "llama"),
                                                         start=False), format="json")
    assert again.status_code == 201 and again.json()["model"] == "llama", again.content
    assert sorted(os.listdir(tmp_path / "models")) == ["llama"]


def test_with_a_model_the_directory_must_hold_it(token_client, two_nodes, weights_root, tmp_path, run) -> None:
    config = json.loads((weights_root / "llama" / "config.json").read_text())
    assert token_client.post("/api/models", {"name": "my-llama", "config": config}, format="json").status_code == 201
    assert token_client.post("/api/models", {"name": "wide-llama", "config": {**config, "intermediate_size": 96}},
                             format="json").status_code == 201
    ok = token_client.post("/api/jobs/validate", job_body(model="my-llama"), format="json")
    assert ok.status_code == 200 and ok.json()["model"] == "my-llama", ok.content
    refused(token_client.post("/api/jobs/validate", job_body(model="wide-llama"), format="json"), tmp_path,
            "llama/config.json describes another model than", "tensor llm.layers.0.mlp.gate.weight has shape "
            "(64, 32) there, (96, 32) in")
    refused(token_client.post("/api/jobs", job_body(model="tiny-gpt"), format="json"), tmp_path,
            "llama/config.json describes another model than tiny-gpt: tensor llm.embed.weight has shape (128, 32) "
            "there, (512, 64) in tiny-gpt")
    assert not Job.objects.exists()
    # The other fields are still checked beside it.
    both = token_client.post("/api/jobs/validate", job_body(model="wide-llama", global_batch=7), format="json")
    assert both.status_code == 400 and sorted(both.json()) == ["global_batch", "init_from"], both.content


def _symlink_out(root: Path, tmp_path: Path) -> None:
    shutil.copytree(root / "llama", tmp_path / "elsewhere")
    (root / "linked").symlink_to(tmp_path / "elsewhere")


def _file_out(root: Path, tmp_path: Path) -> None:
    shutil.copytree(root / "llama", root / "leaky")
    shard = next(p for p in sorted((root / "leaky").iterdir()) if p.suffix == ".safetensors")
    shutil.copy(shard, tmp_path / "outside.safetensors")
    shard.unlink()
    shard.symlink_to(tmp_path / "outside.safetensors")


def _edit(name: str, change):
    def edit(root: Path, tmp_path: Path) -> None:
        shutil.copytree(root / "llama", root / name)
        change(root / name)
    return edit


def _config(**changes):
    def change(folder: Path) -> None:
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return change


def _drop_shard(folder: Path) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    (folder / sorted(set(index["weight_map"].values()))[-1]).unlink()


def _truncate(folder: Path) -> None:
    shard = folder / sorted(p.name for p in folder.iterdir() if p.suffix == ".safetensors")[0]
    shard.write_bytes(shard.read_bytes()[:40])


@pytest.mark.parametrize("value,prepare,words", [
    ("../llama", None, ["'../llama' is outside the weights root (DYNAPLANE_WEIGHTS_ROOT)"]),
    ("/etc", None, ["the absolute path given is outside the weights root"]),
    ("linked", _symlink_out, ["'linked' is outside the weights root", "symlinks may not lead out of it"]),
    ("leaky", _file_out, ["leaky/model-00001-of-", "leads outside the weights root (a symlink)"]),
    ("nothing", None, ["nothing: no such directory under the weights root"]),
    ("", None, ["give the Hugging Face model directory, relative to the weights root"]),
    ("empty", lambda root, _: (root / "empty").mkdir(), ["empty/config.json: no such file"]),
    ("bert", _edit("bert", _config(model_type="bert")), ["bert/config.json: unsupported model_type 'bert'"]),
    ("short", _edit("short", _drop_shard), ["short/model-0000", "missing shard file"]),
    ("broken", _edit("broken", _truncate), ["broken/model-00001-of-", "not a readable safetensors file"]),
    ("narrow", _edit("narrow", _config(hidden_size=16)),
     ["narrow/model-00001-of-", "has shape (128, 32) but config.json implies (128, 16)"]),
])
def test_a_bad_directory_is_a_400_naming_init_from(token_client, two_nodes, weights_root, tmp_path, value, prepare,
                                                   words) -> None:
    if prepare is not None:
        prepare(weights_root, tmp_path)
    for url in ("/api/jobs/validate", "/api/jobs"):
        # (as JSON text, as a program may send it)
        response = token_client.post(url, json.dumps(job_body(init_from=value)), content_type="application/json")
        if value == "":  # empty: no initial weights, and then no model either
            assert response.status_code == 400 and list(response.json()) == ["model"], response.content
            continue
        refused(response, tmp_path, *words)
    assert not Job.objects.exists() and not (tmp_path / "models").exists()


def test_initial_weights_or_a_resume_not_both(token_client, two_nodes, weights_root, tmp_path, settings) -> None:
    response = token_client.post("/api/jobs/validate", job_body(resume_from="some/step-00000010-0"), format="json")
    refused(response, tmp_path, "initial weights or resumes from a checkpoint (resume_from), not both")


def test_only_the_first_start_carries_the_weights(token_client, two_nodes, weights_root, sent_tasks, run) -> None:
    response = run(token_client.post, "/api/jobs", job_body(gpus=4, checkpoint_interval=10), format="json")
    job = Job.objects.get(pk=response.json()["id"])
    orders = [protocol.JobStartOrder.model_validate(m) for m, _ in sent_of(sent_tasks, protocol.NODE_JOB_START)]
    assert len(orders) == 2 and {o.init_from for o in orders} == {str(weights_root / "llama")}
    run(job_record_report, report=report_of(job.pk, "started", "node-1"))
    trained_to(run, job, 14, 10)
    assert lose_node(run, "node-2", keep="node-1") == ["node-2"]
    sent_tasks.clear()
    run(restore.job_restore, job_id=job.pk)
    ((message, _),) = sent_of(sent_tasks, protocol.NODE_JOB_START)
    order = protocol.JobStartOrder.model_validate(message)
    assert (order.restore_from, order.init_from) == ("/ckpt/step-00000010", "")  # the checkpoint has the state


def test_the_pages_show_and_ask_for_initial_weights(browser_client, token_client, two_nodes, weights_root,
                                                    run) -> None:
    job = run(token_client.post, "/api/jobs", job_body(start=False), format="json").json()
    html = browser_client.get(f"/jobs/{job['id']}/").content.decode()
    assert "initial weights <code>llama</code>" in html
    assert embedded_json(html, "job-data")["init_from"] == "llama"
    form = browser_client.get("/jobs/").content.decode()
    assert 'name="init_from"' in form and 'name="eval_every"' in form and 'name="eval_batches"' in form
    assert '<option value="">from the initial weights' in form
