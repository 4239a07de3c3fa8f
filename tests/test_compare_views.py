"""The compare page's views: the query string reopens a comparison; data and CSV of runs."""
from __future__ import annotations

import csv
import io
import json

import pytest

from controlplane.emulation.models import EmulationRun

pytestmark = pytest.mark.django_db

RESULT = {"step_seconds": 0.02, "tokens_per_second": 25600.0, "model_tflops_per_gpu": 1.0,
          "hardware_tflops_per_gpu": 1.2, "mfu": 0.1,
          "breakdown": {"compute": 0.015, "tp_comm": 0.003, "dp_comm": 0.002, "pp_comm": 0.0, "bubble": 0.0},
          "memory": {"peak_bytes": 2**30, "capacity_bytes": 80 * 2**30, "fits": True,
                     "per_stage": [{"stage": 0, "params": 1, "grads": 2, "optimizer": 3, "activations": 4, "peak": 10}]}}


@pytest.fixture
def signed_in(client, django_user_model):
    django_user_model.objects.create_user("bob", password="pw-bob-12345")
    client.login(username="bob", password="pw-bob-12345")
    return client


def _runs() -> list[EmulationRun]:
    common = dict(model="tiny-gpt", gpus=4, gpu_type="h100", global_batch=8, micro_batch=1, seq_len=64)
    return [EmulationRun.objects.create(layout="tp=2,dp=2", state="done", result=RESULT, **common),
            EmulationRun.objects.create(layout="dp=4", state="failed", error="out of memory on stage 0", **common)]


def _initial(response) -> dict:
    html = response.content.decode()
    start = html.index('<script id="compare-initial" type="application/json">') + len(
        '<script id="compare-initial" type="application/json">')
    return json.loads(html[start:html.index("</script>", start)])


def test_the_page_needs_a_sign_in(client) -> None:
    response = client.get("/compare/")
    assert response.status_code == 302 and "/accounts/login/" in response["Location"]
    assert client.get("/compare/export.csv?runs=1").status_code == 302


def test_the_url_reopens_the_same_comparison(signed_in) -> None:
    a, b = _runs()
    response = signed_in.get(f"/compare/?model=tiny-gpt&gpu=a100&gpus=4&batch=8&micro=1&seq=64"
                             f"&layout=tp%3D2%2Cdp%3D2&layout=dp%3D4&runs={a.pk},{b.pk}")
    assert response.status_code == 200
    initial = _initial(response)
    assert initial["settings"]["layouts"] == ["tp=2,dp=2", "dp=4"] and initial["settings"]["gpu"] == "a100"
    assert [r["id"] for r in initial["snapshot"]["runs"]] == [a.pk, b.pk]
    assert initial["figures"]["breakdown"]["data"][0]["y"] == [15.0, None]
    assert b'<option value="a100" selected>' in response.content


def test_bad_query_values_are_named_and_replaced_by_defaults(signed_in) -> None:
    response = signed_in.get("/compare/?gpus=four&gpu=tpu&runs=1,x")
    text = response.content.decode()
    assert response.status_code == 200
    assert "gpus: &#x27;four&#x27; is not a positive integer; using 4" in text
    assert "gpu: &#x27;tpu&#x27; is not one of" in text
    assert "runs: &#x27;x&#x27; is not a run id" in text
    assert _initial(response)["snapshot"]["ids"] == []


def test_data_and_csv_of_runs(signed_in) -> None:
    a, b = _runs()
    data = signed_in.get(f"/compare/data?runs={b.pk},{a.pk}").json()
    assert [r["layout"] for r in data["snapshot"]["runs"]] == ["dp=4", "tp=2,dp=2"]
    assert data["figures"]["settings"][0] == {"setting": "layout", "label": "layout", "values": ["dp=4", "tp=2,dp=2"],
                                              "differs": True}
    response = signed_in.get(f"/compare/export.csv?runs={a.pk},{b.pk}")
    assert response["Content-Type"].startswith("text/csv")
    assert f'filename="dynaplane-compare-{a.pk}-{b.pk}.csv"' in response["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(response.content.decode())))
    assert [(r["layout"], r["state"], r["step_seconds"]) for r in rows] == [("tp=2,dp=2", "done", "0.02"),
                                                                            ("dp=4", "failed", "")]
    assert rows[1]["error"] == "out of memory on stage 0"
    assert signed_in.get("/compare/data?runs=").json() == {"error": "runs: give at least one run id, e.g. ?runs=3,4"}
    assert signed_in.get("/compare/export.csv?runs=-1").status_code == 400
