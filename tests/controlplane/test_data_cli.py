"""`dynaplane data register` and `dynaplane data list` (issue 42) against a live control plane
(pytest-django's live server, real database): the API's answer printed, its refusals as a clear
error and exit code 2, the URL and token taken from a running `dynaplane up`'s stack.json."""
from __future__ import annotations

import json

import pytest
from rest_framework.authtoken.models import Token

from dynaplane.cli import main
from tests.support.datasets import text_dataset


@pytest.fixture
def api(live_server, settings, tmp_path, django_user_model) -> list[str]:
    settings.DYNAPLANE_DATA_ROOT = str(tmp_path / "data")
    user = django_user_model.objects.create_user("cli", password="pw-cli-12345")
    return ["--url", live_server.url, "--token", Token.objects.create(user=user).key]


def test_register_then_list(api, tmp_path, capsys) -> None:
    text_dataset(tmp_path / "data" / "code")
    assert main(["data", "register", "code", "--name", "mine", *api]) == 0
    out = capsys.readouterr().out
    assert out.startswith("registered mine (id ") and "code under the data root, megatron, 4 documents" in out
    assert main(["data", "list", *api]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["id", "name", "tokens", "documents", "vocab", "tokenizer", "validation", "jobs", "path"]
    assert table[1].split()[1:] == ["mine", table[1].split()[2], "4", "257", "bytes", "0", "0", "code"]
    assert main(["data", "list", "--json", *api]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out)] == ["mine"]


def test_a_local_directory_is_sent_as_its_absolute_path(api, tmp_path, capsys, monkeypatch) -> None:
    text_dataset(tmp_path / "data" / "team" / "py")
    monkeypatch.chdir(tmp_path / "data")
    assert main(["data", "register", "team/py", "--json", *api]) == 0
    assert json.loads(capsys.readouterr().out)["path"] == "team/py"


def test_refusals_are_clear_errors(api, tmp_path, capsys) -> None:
    text_dataset(tmp_path / "outside")
    assert main(["data", "register", str(tmp_path / "outside"), *api]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dynaplane data register: path: the absolute path given is outside the data root"), err
    assert str(tmp_path) not in err
    (tmp_path / "data" / "empty").mkdir(parents=True)
    assert main(["data", "register", "empty", *api]) == 2
    assert "path: empty/dataset.json: missing" in capsys.readouterr().err
    assert main(["data", "register", "empty", "--url", api[1], "--token", "wrong"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err and "the token was refused" in err, err


def test_the_url_and_token_come_from_the_running_stack(api, tmp_path, capsys) -> None:
    text_dataset(tmp_path / "data" / "code")
    var = tmp_path / "var"
    var.mkdir()
    (var / "stack.json").write_text(json.dumps({"url": api[1] + "/", "token": api[3]}))
    assert main(["data", "register", "code", "--var-dir", str(var)]) == 0
    assert main(["data", "list", "--var-dir", str(var), "--json"]) == 0
    assert [r["name"] for r in json.loads(capsys.readouterr().out.splitlines()[-1])] == ["code"]
    assert main(["data", "list", "--var-dir", str(tmp_path / "nowhere")]) == 2
    assert "no control plane to ask: pass --url" in capsys.readouterr().err
