"""Issue 11's hostile inputs, each as the tester sent it: every one is now a 400 that names
the field and the rule, after bounded work, with no server path in it (items 6-10 of the
issue; the schema fuzzer runs against a live stack in tests/integration)."""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from django.conf import settings

from parallelism.layout.catalog import catalog_names
from controlplane.common.api_inputs import MAX_JSON_DEPTH, MAX_PAGE
from controlplane.jobs import scheduling
from controlplane.jobs.models import Job
from tests.controlplane.test_jobs_resize import running_job

pytestmark = pytest.mark.django_db

SERVER_PATHS = (str(settings.BASE_DIR), "/etc", "/root", "/home", "/usr", "/tmp")


def create(token_client, **body):
    return token_client.post("/api/jobs", {"name": "h", "model": "tiny-gpt", "global_batch": 12, **body},
                             format="json")


def assert_400(response, field: str, *words: str, sent: str = "") -> str:
    """A 400 naming `field`, with `words`, and no server path beyond what the client sent."""
    assert response.status_code == 400, (response.status_code, response.content[:500])
    text = " ".join(response.json()[field])
    for word in words:
        assert word in text, text
    told = json.dumps(response.json()).replace(sent, "") if sent else json.dumps(response.json())
    for path in SERVER_PATHS:
        assert path not in told, response.content
    return text


# --- 6: bounded work ---------------------------------------------------------------------------

def test_a_plan_of_a_hundred_thousand_ranks_is_refused_before_any_planning(two_nodes, token_client, run,
                                                                            client) -> None:
    job = running_job(run, token_client, layout="dp=2")
    for layout, words in (("dp=100000", ("100000 GPUs", "at most 65536")),
                          ("dp=65536", ("65536 ranks", "up to 16384"))):
        response = client.get(f"/api/jobs/{job.pk}/plan", {"layout": layout})  # unauthenticated, as reported
        assert_400(response, "layout", *words)
    # (a resize checks the batch first: cheap rules before the plan's)
    assert_400(token_client.post(f"/api/jobs/{job.pk}/resize", {"layout": "dp=65536"}, format="json"),
               "global_batch", "x dp=65536")
    assert_400(client.get(f"/api/jobs/{job.pk}/proposals", {"gpus": "65536"}), "gpus", "from 1 to 16384")


def test_an_emulation_of_more_gpus_than_a_layout_may_span_is_refused(token_client) -> None:
    body = {"model": "tiny-gpt", "layout": "dp=100000", "gpus": 100000, "global_batch": 100000, "seq_len": 128}
    response = token_client.post("/api/emulations", body, format="json")
    assert response.status_code == 400 and "65536" in json.dumps(response.json())


# --- 7: integers beyond the database, huge pages, deep JSON -----------------------------------

@pytest.mark.parametrize("field,value", [("max_steps", 2**63), ("global_batch", 10**20), ("micro_batch", 2**31),
                                         ("checkpoint_interval", 2**40), ("seq_len", 2**40)])
def test_integers_beyond_the_database_range_are_400s(token_client, two_nodes, field, value) -> None:
    assert_400(create(token_client, layout="dp=1", **{field: value}), field, "less than or equal")


def test_a_layout_degree_beyond_any_world_is_a_400(token_client, two_nodes) -> None:
    assert_400(create(token_client, layout="dp=99999999999999999999"), "layout", "digits 0-9")
    body = {"model": "tiny-gpt", "layout": "dp=99999999999999999999", "gpus": 1, "global_batch": 1, "seq_len": 8}
    response = token_client.post("/api/emulations", body, format="json")
    assert response.status_code == 400 and "digits 0-9" in json.dumps(response.json())


def test_list_pages_are_bounded(token_client, two_nodes) -> None:
    for i in range(3):
        scheduling.job_submit(name=f"p{i}", model="tiny-gpt", layout="dp=1", start=False)
    response = token_client.get("/api/jobs", {"limit": str(10**12)})
    assert response.status_code == 200 and len(response.json()["results"]) == 3
    assert "limit=1000" in (response.json()["next"] or "limit=1000") and MAX_PAGE == 1000
    response = token_client.get("/api/jobs", {"offset": str(10**30)})
    assert response.status_code == 200 and response.json()["results"] == []
    for query in ({"job": "²"}, {"job": "9" * 30}, {"limit": "-5"}, {"offset": "abc"}):
        assert token_client.get("/api/transitions", query).status_code == 200, query
    job = Job.objects.get(name="p0")
    for gpus in ("²", "１", "0", "-1", "9" * 30):
        assert_400(token_client.get(f"/api/jobs/{job.pk}/proposals", {"gpus": gpus}), "gpus", "integer from 1")


def test_deeply_nested_json_is_a_400(token_client) -> None:
    for body in ("[" * 5000 + "]" * 5000, '{"a":' * 5000 + "1" + "}" * 5000):
        response = token_client.post("/api/jobs", body, content_type="application/json")
        assert response.status_code == 400 and f"deeper than {MAX_JSON_DEPTH}" in response.json()["detail"]
    nested_ok = json.dumps({"name": "ok", "model": "tiny-gpt", "layout": "dp=1", "extra": [[[1]]]})
    assert token_client.post("/api/jobs", nested_ok, content_type="application/json").status_code != 500
    for body in ("NaN", "[1, Infinity]", "\xff"):
        response = token_client.post("/api/emulations", body.encode("latin-1"), content_type="application/json")
        assert response.status_code == 400, body
    for body in ("[]", "3", '"x"'):  # not an object
        response = token_client.post("/api/emulations", body, content_type="application/json")
        assert response.status_code == 400, body


# --- 8: models and checkpoints stay where they belong -----------------------------------------

@pytest.mark.parametrize("model", ["dynaplane/../../../../etc/passwd", "/etc/passwd", "../manage.py", "manage.py",
                                   "README.md", "controlplane"])
def test_a_model_is_never_a_path_on_the_server(token_client, two_nodes, model) -> None:
    response = create(token_client, model=model, layout="dp=1")
    assert_400(response, "model", sent=model)
    emulation = token_client.post("/api/emulations", {"model": model, "layout": "dp=1", "gpus": 1,
                                                      "global_batch": 1, "seq_len": 8}, format="json")
    assert emulation.status_code == 400
    for path in SERVER_PATHS:
        assert path not in json.dumps(emulation.json()).replace(model, "")


def test_a_stored_model_config_is_a_model_by_its_name(token_client, two_nodes, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DYNAPLANE_MODELS_DIR", str(tmp_path))
    folder = tmp_path / "tiny-llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256, "tie_word_embeddings": False}))
    response = create(token_client, model="tiny-llama", layout="dp=1", start=False)
    assert response.status_code == 201, response.content
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    text = assert_400(create(token_client, name="b", model="broken", layout="dp=1"), "model", "stored model 'broken'")
    assert str(tmp_path) not in text
    assert "tiny-llama" not in catalog_names()


@pytest.mark.parametrize("field", ["checkpoint_dir", "resume_from"])
@pytest.mark.parametrize("value", ["/etc", "../outside", "/", "a/../../b"])
def test_checkpoint_folders_stay_under_the_checkpoint_root(token_client, two_nodes, field, value) -> None:
    assert_400(create(token_client, layout="dp=1", **{field: value}), field, "outside the checkpoint root", sent=value)


def test_a_relative_checkpoint_folder_is_taken_from_the_root(token_client, two_nodes) -> None:
    response = create(token_client, layout="dp=1", checkpoint_dir="team-a/run-1", start=False)
    assert response.status_code == 201, response.content
    root = os.path.realpath(settings.DYNAPLANE_CHECKPOINT_ROOT)
    assert response.json()["checkpoint_dir"] == os.path.join(root, "team-a", "run-1")


# --- 9: one validation path for jobs and emulations -------------------------------------------

def test_job_creation_checks_what_emulation_checks(token_client, two_nodes) -> None:
    assert_400(create(token_client, layout="dp=2", global_batch=3), "global_batch", "micro_batch=1 x dp=2")
    assert_400(create(token_client, layout="dp=2", global_batch=3, start=False), "global_batch", "x dp=2")
    emulation = token_client.post("/api/emulations", {"model": "tiny-gpt", "layout": "dp=2", "gpus": 2,
                                                      "global_batch": 3, "seq_len": 8}, format="json")
    assert emulation.status_code == 400 and "micro_batch=1 x dp=2" in json.dumps(emulation.json())
    assert_400(create(token_client, layout="dp=２"), "layout", "digits 0-9")  # a full-width digit
    assert_400(create(token_client, layout="dp=1", seq_len=1_048_576), "seq_len", "predicted", "exceeds the smallest")
    assert_400(create(token_client, gpus=65536, start=False), "gpus", "spans 65536 GPUs; the cluster has 4")
    assert not Job.objects.exists()


def test_learned_positions_bound_the_sequence(token_client, two_nodes) -> None:
    body = {"model": "gpt3-175b", "layout": "tp=8,pp=16,dp=8", "gpus": 1024, "global_batch": 1536,
            "seq_len": 4096}
    response = token_client.post("/api/emulations", body, format="json")
    assert response.status_code == 400 and "2048 learned positions" in json.dumps(response.json())


# --- 10: the token store is private, and programs may use the websocket -------------------------

def test_the_sqlite_file_is_readable_by_its_owner_only(tmp_path) -> None:
    from controlplane.settings import private_files

    fresh = tmp_path / "new.sqlite3"
    private_files(str(fresh))
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o600
    old = tmp_path / "old.sqlite3"
    for path in (old, Path(f"{old}-wal")):
        path.write_text("")
        path.chmod(0o644)
    private_files(str(old))
    assert stat.S_IMODE(old.stat().st_mode) == stat.S_IMODE(Path(f"{old}-wal").stat().st_mode) == 0o600


@pytest.mark.django_db(transaction=True)
@pytest.mark.asyncio
async def test_a_program_connects_with_a_token_and_no_origin_a_foreign_page_does_not(user) -> None:
    from channels.db import database_sync_to_async
    from channels.testing import WebsocketCommunicator
    from rest_framework.authtoken.models import Token

    from controlplane.asgi import application

    key = (await database_sync_to_async(Token.objects.create)(user=user)).key
    program = WebsocketCommunicator(application, "/ws/cluster/", headers=[
        (b"host", b"localhost"), (b"authorization", f"Token {key}".encode())])
    connected, _ = await program.connect()
    assert connected
    await program.disconnect()
    foreign = WebsocketCommunicator(application, "/ws/cluster/", headers=[
        (b"host", b"localhost"), (b"origin", b"http://evil.example"), (b"authorization", f"Token {key}".encode())])
    connected, _ = await foreign.connect()
    assert not connected
