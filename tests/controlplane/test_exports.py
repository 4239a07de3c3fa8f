"""Exporting a job's checkpoint as a Hugging Face directory (issue 42): POST /api/jobs/{id}/export
queues the export of one of the job's complete checkpoints (default the latest) on the `exports`
queue; the task, run here for real and synchronously, writes `<exports root>/<job>-step-<N>/`,
which safetensors and transformers load, its tensors the checkpoint's fp32 masters cast to bf16
(or, for a job started from a Hugging Face directory, that directory's split and dtypes: without
training, the same bytes). Progress and the result arrive as `export` events on the job's stream
and in GET /api/exports/{id} and /api/jobs/{id}/exports; `dynaplane export` follows it. Refusals:
409 without a checkpoint or while another export runs, 400 naming `checkpoint_step` or `name`.

The checkpoints are real: ranks (run_ranks, gloo) train tiny-gpt and write a checkpoint with the
agents' own Checkpointer (agents/runtime/checkpoints.py), or load a tiny Llama with
hf_initial_shards and write one; the oracle is the masters the ranks hold after saving."""
from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from controlplane.exports import services
from controlplane.exports.models import Export
from controlplane.jobs.events import ExportEvent, JobLiveSnapshot, apply_job_event, job_event_adapter
from controlplane.jobs.models import Job
from controlplane.jobs.selectors import job_live_snapshot
from tests.controlplane.conftest import embedded_json
from tests.controlplane.test_datasets import no_server_path
from tests.controlplane.test_jobs_restore import sent_of
from tests.parallelism.hf_weights.tiny_hf import unpack
from tests.support.checkpoints import load_and_checkpoint, train_and_checkpoint

pytestmark = pytest.mark.django_db
STEP = 2


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """tiny-gpt trained 2 steps on dp=2 with ZeRO-1 (each rank holds half of every master), its
    checkpoint folder (step-00000002-0) and the whole masters."""
    from parallelism.engine.launch import run_ranks
    from parallelism.hf_weights import assemble
    from parallelism.layout.catalog import get_model

    root = tmp_path_factory.mktemp("trained")
    results = run_ranks(2, train_and_checkpoint, str(root), "tiny-gpt", "dp=2,zero=1", STEP, timeout_s=240)
    masters = assemble(get_model("tiny-gpt"), [s for r in results for s in unpack(r)])
    return root / f"step-{STEP:08d}-0", masters


@pytest.fixture
def roots(settings, tmp_path, monkeypatch) -> Path:
    for name in ("CHECKPOINT", "EXPORTS", "WEIGHTS"):
        setattr(settings, f"DYNAPLANE_{name}_ROOT", str(tmp_path / name.lower()))
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(tmp_path / "models"))
    return tmp_path


def new_job(run, client, **fields) -> Job:
    body = {"name": "j", "model": "tiny-gpt", "gpus": 2, "global_batch": 4, "seq_len": 16, "start": False,
            "checkpoint_interval": STEP, **fields}
    response = run(client.post, "/api/jobs", body, format="json")
    assert response.status_code == 201, response.content
    return Job.objects.get(pk=response.json()["id"])


def with_checkpoint(job: Job, folder: Path) -> Path:
    """The job's checkpoint folder holds `folder` (as its ranks would have written it)."""
    target = Path(job.checkpoint_dir) / folder.name
    shutil.copytree(folder, target)
    return target


def test_a_checkpoint_exports_to_a_directory_transformers_loads(token_client, two_nodes, roots, trained, sent_tasks,
                                                                sent_events, run) -> None:
    folder, masters = trained
    job = new_job(run, token_client)
    with_checkpoint(job, folder)
    before = JobLiveSnapshot.model_validate(token_client.get(f"/api/jobs/{job.pk}/live").json())
    sent_events.clear()
    response = run(token_client.post, f"/api/jobs/{job.pk}/export", {}, format="json")
    assert response.status_code == 202, response.content
    queued = response.json()
    assert {k: queued[k] for k in ("job", "job_name", "checkpoint_step", "state", "path", "files_written")} == {
        "job": job.pk, "job_name": "j", "checkpoint_step": STEP, "state": "pending", "path": f"j-step-{STEP}",
        "files_written": 0}
    assert sent_of(sent_tasks, services.EXPORT_TASK) == [(queued["id"], "exports")]
    run(services.export_run, export_id=queued["id"])  # the task's work, here and now
    done = token_client.get(f"/api/exports/{queued['id']}").json()
    assert (done["state"], done["error"], done["files_written"], done["files_total"]) == ("done", "", 1, 1)
    out = roots / "exports" / f"j-step-{STEP}"
    assert done["bytes"] == (out / "model.safetensors").stat().st_size and done["seconds"] > 0
    assert sorted(os.listdir(roots / "exports")) == [f"j-step-{STEP}"]  # (the partial folder was renamed)
    # safetensors: every tensor is the checkpoint's master cast to bf16 (the export's dtype without a source)
    from parallelism.hf_weights import read_hf_tensors

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    assert embed.dtype == torch.bfloat16 and torch.equal(embed, masters["llm.embed.weight"].bfloat16())
    exported = read_hf_tensors(str(out), dtype=None)
    assert sorted(exported) == sorted(masters)
    for name, value in masters.items():
        assert exported[name].dtype == torch.bfloat16 and torch.equal(exported[name], value.bfloat16()), name
    # transformers loads it: its embedding and first q projection are ours
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16)
    assert torch.equal(model.model.embed_tokens.weight, masters["llm.embed.weight"].bfloat16())
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight,
                       masters["llm.layers.0.attn.q.weight"].bfloat16())
    # the job's stream: pending, running, planned, done; snapshot + events == later snapshot
    events = [e for e in sent_events if isinstance(e, ExportEvent)]
    assert [(e.export.state, e.export.files_total, e.export.files_written) for e in events] == [
        ("pending", None, 0), ("running", None, 0), ("running", 1, 0), ("done", 1, 1)]
    for event in events:
        before = apply_job_event(before, job_event_adapter.validate_json(event.model_dump_json()))
    assert before == job_live_snapshot(job_id=job.pk)
    listed = token_client.get(f"/api/jobs/{job.pk}/exports").json()
    assert listed["count"] == 1 and listed["results"][0] == done
    assert [r["id"] for r in token_client.get("/api/exports").json()["results"]] == [done["id"]]
    assert set(done) == set(events[-1].export.model_dump())  # the API's and the event's shapes agree
    # the same directory again: refused naming `name`; another name is another export
    again = token_client.post(f"/api/jobs/{job.pk}/export", {}, format="json")
    assert again.status_code == 400 and again.json() == {"name": [
        f"j-step-{STEP} exists already under the exports root: give another name"]}
    other = run(token_client.post, f"/api/jobs/{job.pk}/export", {"name": "mine", "checkpoint_step": STEP},
                format="json")
    assert other.status_code == 202 and other.json()["path"] == "mine", other.content


def test_a_job_started_from_a_hf_directory_exports_in_its_split_and_dtypes(token_client, two_nodes, roots,
                                                                          sent_tasks, run) -> None:
    """Without training, the export of a job started from a sharded fp32 Llama is that directory
    again: the same files, index, tensor bytes and config.json (source_dir = its init_from)."""
    from parallelism.engine.launch import run_ranks
    from tests.parallelism.hf_weights.test_export import assert_byte_identical
    from tests.parallelism.hf_weights.tiny_hf import save_hf_model

    hf = save_hf_model("llama", roots / "weights" / "llama", max_shard_size="20KB")
    job = new_job(run, token_client, model=None, init_from="llama")
    run_ranks(1, load_and_checkpoint, job.checkpoint_dir, hf, timeout_s=240)  # step-00000000-0, the loaded state
    exported = run(token_client.post, f"/api/jobs/{job.pk}/export", {"name": "llama-again"}, format="json").json()
    assert exported["checkpoint_step"] == 0
    run(services.export_run, export_id=exported["id"])
    row = Export.objects.get(pk=exported["id"])
    assert (row.state, row.error, row.source) == ("done", "", "llama")
    assert row.files_written == row.files_total == len([f for f in os.listdir(hf) if f.endswith(".safetensors")]) > 1
    assert_byte_identical(hf, str(roots / "exports" / "llama-again"))


def test_without_a_checkpoint_an_export_is_a_409_saying_why(token_client, two_nodes, roots, run) -> None:
    job = new_job(run, token_client)
    response = token_client.post(f"/api/jobs/{job.pk}/export", {}, format="json")
    assert response.status_code == 409, response.content
    assert response.json()["detail"] == (f"job 'j' has no checkpoint yet: set checkpoint_interval; the first comes at "
                                         f"step {STEP} (checkpoint_interval)")
    off = new_job(run, token_client, name="k", checkpoint_interval=0)
    response = token_client.post(f"/api/jobs/{off.pk}/export", {}, format="json")
    assert response.status_code == 409 and "its checkpoint_interval is 0 (checkpoints are off)" in \
        response.json()["detail"]
    assert not Export.objects.exists()


@pytest.mark.parametrize("body,field,words", [
    ({"checkpoint_step": 7}, "checkpoint_step", ["job 'j' has no complete checkpoint of step 7 (it has step 2"]),
    ({"checkpoint_step": -1}, "checkpoint_step", ["greater than or equal to 0"]),
    ({"checkpoint_step": "latest"}, "checkpoint_step", ["A valid integer is required"]),
    ({"name": "../up"}, "name", ["'../up' is not an export name"]),
    ({"name": ".hidden"}, "name", ["is not an export name"]),
    ({"name": "x" * 101}, "name", ["no more than 100 characters"]),
])
def test_bad_export_requests_are_400s_naming_the_field(token_client, two_nodes, roots, trained, run, body, field,
                                                       words) -> None:
    job = new_job(run, token_client)
    with_checkpoint(job, trained[0])
    response = token_client.post(f"/api/jobs/{job.pk}/export", body, format="json")
    assert response.status_code == 400 and list(response.json()) == [field], response.content
    for word in words:
        assert word in response.json()[field][0], response.json()
    no_server_path(response, roots)
    assert not Export.objects.exists()


def test_exports_need_a_token_and_a_job(client, token_client, two_nodes, roots, run) -> None:
    job = new_job(run, token_client)
    assert client.post(f"/api/jobs/{job.pk}/export", {}, content_type="application/json").status_code in (401, 403)
    assert token_client.post("/api/jobs/999999/export", {}, format="json").status_code == 404
    assert token_client.get("/api/jobs/999999/exports").status_code == 404
    assert token_client.get("/api/exports/999999").status_code == 404


def test_one_export_at_a_time_and_a_stale_one_is_failed(token_client, two_nodes, roots, trained, sent_tasks,
                                                        run) -> None:
    first, second = new_job(run, token_client), new_job(run, token_client, name="k")
    for job in (first, second):
        with_checkpoint(job, trained[0])
    busy = run(token_client.post, f"/api/jobs/{first.pk}/export", {}, format="json").json()
    response = token_client.post(f"/api/jobs/{second.pk}/export", {}, format="json")
    assert response.status_code == 409 and response.json()["detail"].startswith(
        f"export {busy['id']} (job 'j', step {STEP}) is pending: the control worker exports one checkpoint at a time")
    Export.objects.filter(pk=busy["id"]).update(updated_at=Export.objects.get(pk=busy["id"]).updated_at
                                                - timedelta(seconds=services.STALE_SECONDS + 1))
    response = run(token_client.post, f"/api/jobs/{second.pk}/export", {}, format="json")
    assert response.status_code == 202, response.content
    stale = token_client.get(f"/api/exports/{busy['id']}").json()
    assert stale["state"] == "failed" and stale["error"].startswith("no progress for 30 min")
    # A redelivered task leaves a row that is no longer pending alone.
    assert run(services.export_run, export_id=busy["id"]).state == "failed"


def test_a_failed_export_says_why_and_leaves_no_directory(token_client, two_nodes, roots, trained, run,
                                                          monkeypatch) -> None:
    job = new_job(run, token_client)
    folder = with_checkpoint(job, trained[0])
    (folder / ".metadata").unlink()  # a DCP checkpoint without its metadata
    queued = run(token_client.post, f"/api/jobs/{job.pk}/export", {}, format="json").json()
    row = run(services.export_run, export_id=queued["id"])
    assert row.state == "failed" and row.finished_at is not None, row.error
    assert row.error == f"j-{job.pk}/step-{STEP:08d}-0: not a DCP checkpoint (no .metadata)", row.error
    assert str(roots) not in token_client.get(f"/api/exports/{row.pk}").content.decode()
    assert not (roots / "exports").exists() or os.listdir(roots / "exports") == []  # no partial folder left
    # A failed export does not hold its directory's name; one that fails while writing leaves nothing.
    shutil.copy(trained[0] / ".metadata", folder / ".metadata")
    queued = run(token_client.post, f"/api/jobs/{job.pk}/export", {}, format="json").json()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    import parallelism.hf_weights

    monkeypatch.setattr(parallelism.hf_weights, "read_checkpoint_masters", full)
    row = run(services.export_run, export_id=queued["id"])
    assert (row.state, row.error, row.files_total) == ("failed", "[Errno 28] No space left on device", 1)
    assert os.listdir(roots / "exports") == []


def test_the_cli_exports_and_follows_it(live_server, settings, tmp_path, monkeypatch, trained, capsys,
                                        django_user_model) -> None:
    """`dynaplane export JOB` against a live control plane whose `exports` queue runs the task at once."""
    from rest_framework.authtoken.models import Token

    from controlplane.celery import app
    from controlplane.cluster import services as cluster
    from controlplane.jobs.services import job_create
    from dynaplane.cli import main
    from tests.controlplane.conftest import heartbeat

    for name in ("CHECKPOINT", "EXPORTS"):
        setattr(settings, f"DYNAPLANE_{name}_ROOT", str(tmp_path / name.lower()))
    cluster.node_record_heartbeat(report=heartbeat("node-1", gpus=2))
    job = job_create(name="cli-job", model="tiny-gpt", gpus=2, global_batch=4, seq_len=16, checkpoint_interval=STEP)
    with_checkpoint(job, trained[0])
    monkeypatch.setattr(app, "send_task", lambda name, args=None, queue=None, **_: services.export_run(
        export_id=args[0]))
    user = django_user_model.objects.create_user("cli", password="pw-cli-12345")
    api = ["--url", live_server.url, "--token", Token.objects.create(user=user).key]
    assert main(["export", "cli-job", *api]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"exported cli-job step {STEP} to cli-job-step-{STEP} under the exports root: 1 files")
    assert (tmp_path / "exports" / f"cli-job-step-{STEP}" / "model.safetensors").is_file()
    assert main(["export", str(job.pk), "--step", "5", *api]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaplane export: checkpoint_step: job 'cli-job' has no complete checkpoint of step 5"), err
    assert main(["export", "no-such-job", *api]) == 2
    assert "no job named 'no-such-job'" in capsys.readouterr().err
    assert main(["export", "cli-job", "--name", "again", "--json", "--no-wait", *api]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == "again"


def test_the_job_page_shows_its_exports_and_the_export_button(browser_client, token_client, two_nodes, roots,
                                                              trained, run) -> None:
    job = new_job(run, token_client)
    html = browser_client.get(f"/jobs/{job.pk}/").content.decode()
    assert 'id="export-button"' in html and "Export to Hugging Face" in html
    assert embedded_json(html, "job-exports") == [] and embedded_json(html, "job-data")["checkpoint_interval"] == STEP
    with_checkpoint(job, trained[0])
    queued = run(token_client.post, f"/api/jobs/{job.pk}/export", {}, format="json").json()
    run(services.export_run, export_id=queued["id"])
    (shown,) = embedded_json(browser_client.get(f"/jobs/{job.pk}/").content.decode(), "job-exports")
    assert {k: shown[k] for k in ("id", "state", "path", "files_written", "files_total")} == {
        "id": queued["id"], "state": "done", "path": f"j-step-{STEP}", "files_written": 1, "files_total": 1}
