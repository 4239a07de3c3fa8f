"""Datasets in the control plane (issue 42): POST /api/datasets registers a dataset directory that
lies under the data root, checked by the dataset library's describe() (nothing mocked: the
directories here are written by `prepare` and the IndexedWriter); list, detail, delete (409 while
a job names it); every refusal is a 400 naming the field and the rule, with paths relative to the
data root and no absolute path of the server in the body."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from parallelism.datasets.describe import describe
from tests.support.datasets import text_dataset, token_dataset

pytestmark = pytest.mark.django_db


def no_server_path(response, tmp_path: Path) -> None:
    text = response.content.decode()
    for path in {str(tmp_path), os.path.realpath(tmp_path), os.environ["DYNAPLANE_VAR_DIR"]}:
        assert path not in text, text


def refused(response, field: str, tmp_path: Path, *words: str) -> str:
    assert response.status_code == 400, response.content
    body = response.json()
    assert list(body) == [field], body
    message = " ".join(body[field])
    for word in words:
        assert word in message, message
    no_server_path(response, tmp_path)
    return message


def register(client, path, **body):
    # (as JSON text: a lone surrogate is sent escaped, as a program may send it)
    return client.post("/api/datasets", json.dumps({"path": str(path), **body}), content_type="application/json")


def test_register_list_read_and_delete(token_client, data_root, tmp_path) -> None:
    text_dataset(data_root / "code", validation_fraction=0.25, name="code")
    response = register(token_client, "code")
    assert response.status_code == 201, response.content
    row = response.json()
    info = describe(data_root / "code", 1)
    assert {k: row[k] for k in ("name", "path", "format", "vocab_size", "eos_token", "tokenizer", "fingerprint",
                                "documents", "tokens", "train_tokens", "validation_tokens", "validation_fraction",
                                "validation_documents", "tokenizer_fingerprint")} == {
        "name": "code", "path": "code", "format": "megatron", "vocab_size": 257, "eos_token": 256,
        "tokenizer": "bytes", "fingerprint": info["fingerprint"], "documents": 4, "tokens": info["tokens"],
        "train_tokens": info["train_tokens"], "validation_tokens": info["validation_tokens"],
        "validation_fraction": 0.25, "validation_documents": info["validation_documents"],
        "tokenizer_fingerprint": "bytes-v1"}
    assert row["jobs"] == [] and row["parts"] == [] and info["validation_tokens"] > 0
    no_server_path(response, tmp_path)
    listed = token_client.get("/api/datasets").json()
    assert listed["count"] == 1 and listed["results"][0]["name"] == "code"
    assert token_client.get(f"/api/datasets/{row['id']}").json() == row
    assert token_client.get("/api/datasets/999999").status_code == 404
    assert token_client.delete(f"/api/datasets/{row['id']}").status_code == 204
    assert token_client.get(f"/api/datasets/{row['id']}").status_code == 404
    assert (data_root / "code" / "dataset.json").exists()  # a registration is forgotten, the data stays


def test_an_absolute_path_inside_the_root_is_stored_relative_and_the_name_defaults(token_client, data_root) -> None:
    text_dataset(data_root / "team" / "py", name="Not a name!")
    response = register(token_client, data_root / "team" / "py")
    assert response.status_code == 201, response.content
    assert (response.json()["path"], response.json()["name"]) == ("team/py", "py")  # the manifest's is no name
    named = register(token_client, "team/../team/py/", name="again")
    refused(named, "path", data_root.parent, "team/py is registered already, as 'py'")


def test_writes_need_a_token(data_root) -> None:
    text_dataset(data_root / "code")
    assert APIClient().post("/api/datasets", {"path": "code"}, format="json").status_code in (401, 403)
    assert APIClient().get("/api/datasets").status_code == 200


@pytest.mark.parametrize("path", ["..", "../elsewhere", "code/../../elsewhere", "ABSOLUTE", "link", ".", "",
                                  "bad\x00", "lone\ud800surrogate"])
def test_a_path_outside_the_data_root_is_refused(token_client, data_root, tmp_path, path) -> None:
    text_dataset(tmp_path / "elsewhere")  # a good dataset, outside the root
    os.symlink(tmp_path / "elsewhere", data_root / "link")
    text_dataset(data_root / "code")
    path = str(tmp_path / "elsewhere") if path == "ABSOLUTE" else path
    message = refused(register(token_client, path), "path", tmp_path)
    assert any(word in message for word in ("outside the data root", "may not be blank", "Null characters", "Surrogate characters")), message


def test_a_symlinked_data_file_leading_out_of_the_root_is_refused(token_client, data_root, tmp_path) -> None:
    text_dataset(tmp_path / "elsewhere")
    text_dataset(data_root / "code")
    os.remove(data_root / "code" / "data.bin")
    os.symlink(tmp_path / "elsewhere" / "data.bin", data_root / "code" / "data.bin")
    refused(register(token_client, "code"), "path", tmp_path, "code: data.bin: leads outside the data root")


def test_a_blend_part_outside_the_root_is_refused(token_client, data_root, tmp_path) -> None:
    import json

    text_dataset(tmp_path / "elsewhere")
    text_dataset(data_root / "inside")
    (data_root / "blend").mkdir()
    manifest = {"version": 1, "name": "blend", "format": "blend", "vocab_size": 257, "fingerprint": "sha256:x",
                "parts": [{"path": "../inside", "weight": 1}, {"path": str(tmp_path / "elsewhere"), "weight": 1}]}
    (data_root / "blend" / "dataset.json").write_text(json.dumps(manifest))
    refused(register(token_client, "blend"), "path", tmp_path, "parts[1] lies outside the data root")
    manifest["parts"] = manifest["parts"][:1] * 2
    (data_root / "blend" / "dataset.json").write_text(json.dumps(manifest))
    response = register(token_client, "blend")
    assert response.status_code == 201, response.content
    assert [p["name"] for p in response.json()["parts"]] == ["inside", "inside"]


def test_no_directory_or_no_manifest_is_refused(token_client, data_root, tmp_path) -> None:
    refused(register(token_client, "nothing-here"), "path", tmp_path, "nothing-here: no such directory")
    (data_root / "empty").mkdir()
    refused(register(token_client, "empty"), "path", tmp_path, "empty/dataset.json: missing")
    (data_root / "team" / "broken").mkdir(parents=True)
    (data_root / "team" / "broken" / "dataset.json").write_text("{not json")
    refused(register(token_client, "team/broken"), "path", tmp_path, "team/broken/dataset.json: not readable JSON")


def test_a_truncated_bin_or_a_corrupt_idx_is_refused_in_the_library_s_words(token_client, data_root,
                                                                           tmp_path) -> None:
    text_dataset(data_root / "short")
    with open(data_root / "short" / "data.bin", "r+b") as f:
        f.truncate(os.path.getsize(data_root / "short" / "data.bin") - 6)
    refused(register(token_client, "short"), "path", tmp_path, "short: data.bin:", "truncated")
    text_dataset(data_root / "corrupt")
    raw = (data_root / "corrupt" / "data.idx").read_bytes()
    (data_root / "corrupt" / "data.idx").write_bytes(b"XXIDIDX\x00\x00" + raw[9:])
    refused(register(token_client, "corrupt"), "path", tmp_path, "corrupt: data.idx: not a Megatron index")
    (data_root / "corrupt" / "data.idx").write_bytes(raw[:-8])
    refused(register(token_client, "corrupt"), "path", tmp_path, "data.idx", "truncated or corrupt")


def test_names_are_checked_and_unique(token_client, data_root, tmp_path) -> None:
    text_dataset(data_root / "a")
    text_dataset(data_root / "b")
    assert register(token_client, "a", name="code").status_code == 201
    refused(register(token_client, "b", name="code"), "name", tmp_path, "a dataset named 'code' is registered")
    for bad in ("-x", "12345", "has space", "a/b", "x" * 64):
        assert register(token_client, "b", name=bad).status_code == 400
    assert register(token_client, "b", name="code-2.v1_b").status_code == 201


def test_a_manifest_value_out_of_the_columns_range_is_refused(token_client, data_root, tmp_path) -> None:
    token_dataset(data_root / "huge", [[1, 2, 3]] * 3, vocab_size=2**40)
    refused(register(token_client, "huge"), "path", tmp_path, "huge/dataset.json", "vocab_size=1099511627776")


def test_a_dataset_a_job_names_cannot_be_deleted(token_client, data_root, two_nodes, tmp_path) -> None:
    text_dataset(data_root / "code")
    dataset = register(token_client, "code").json()
    job = token_client.post("/api/jobs", {"name": "j", "model": "tiny-gpt", "gpus": 1, "seq_len": 16,
                                          "dataset": "code", "start": False}, format="json")
    assert job.status_code == 201, job.content
    assert token_client.get(f"/api/datasets/{dataset['id']}").json()["jobs"] == [{"id": job.json()["id"],
                                                                                  "name": "j"}]
    refused_delete = token_client.delete(f"/api/datasets/{dataset['id']}")
    assert refused_delete.status_code == 409 and "used by job(s) j" in refused_delete.json()["detail"]
    assert token_client.delete(f"/api/jobs/{job.json()['id']}").status_code == 204
    assert token_client.delete(f"/api/datasets/{dataset['id']}").status_code == 204
