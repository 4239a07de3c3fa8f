"""The dashboard's datasets (issue 42): the Datasets page lists what is registered (tokens,
documents, vocab, tokenizer, validation split, the jobs that use each) with a register form, and
is in the navigation; the New job form offers the datasets (synthetic tokens by default); the job
page shows its dataset and the data it has read, counted by job-store.js's dataProgress, which
agrees with the API's data_progress (checked under node)."""
from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from controlplane.jobs.reports import job_record_report
from controlplane.jobs.selectors import data_progress
from tests.controlplane.conftest import embedded_json
from tests.support.datasets import text_dataset
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db
STORE = Path(__file__).resolve().parents[2] / "frontend" / "static" / "frontend" / "job-store.js"


@pytest.fixture
def code(settings, tmp_path, token_client) -> dict:
    settings.DYNAPLANE_DATA_ROOT = str(tmp_path / "data")
    text_dataset(tmp_path / "data" / "code", validation_fraction=0.25)
    response = token_client.post("/api/datasets", {"path": "code"}, format="json")
    assert response.status_code == 201, response.content
    return response.json()


def test_the_datasets_page_lists_them_with_the_jobs_using_them(browser_client, token_client, code, two_nodes,
                                                              run) -> None:
    job = run(token_client.post, "/api/jobs", {"name": "on-code", "model": "tiny-gpt", "gpus": 1, "seq_len": 16,
                                               "dataset": "code", "start": False}, format="json").json()
    html = browser_client.get("/datasets/").content.decode()
    assert '<a href="/datasets/">Datasets</a>' in html  # the navigation
    row = html[html.index('id="dataset-code"'):]
    row = row[:row.index("</tr>")]
    assert f'data-tokens="{code["tokens"]}"' in row and ">4</td>" in row and ">257</td>" in row
    assert ">bytes</td>" in row and "25.0 % of the documents" in row
    assert f'<a href="/jobs/{job["id"]}/">on-code</a>' in row and "data-delete" not in row  # used: no Delete
    assert 'id="register-form"' in html and 'id="register-path"' in html


def test_an_unused_dataset_can_be_deleted_from_the_page_and_nothing_is_listed_after(browser_client, code) -> None:
    html = browser_client.get("/datasets/").content.decode()
    assert f'data-delete="{code["id"]}"' in html and 'id="datasets-empty" class="hint" hidden' in html
    from controlplane.datasets.models import Dataset

    Dataset.objects.all().delete()
    html = browser_client.get("/datasets/").content.decode()
    assert 'id="datasets-table"' in html and 'id="datasets-empty" class="hint">' in html


def test_the_datasets_page_needs_a_sign_in(client) -> None:
    assert client.get("/datasets/").status_code == 302


def test_the_new_job_form_offers_the_datasets_synthetic_by_default(browser_client, code) -> None:
    html = browser_client.get("/jobs/").content.decode()
    assert '<option value="" selected>synthetic tokens</option>' in html and '<option value="code">code</option>' in html
    (listed,) = embedded_json(html, "dataset-list")
    assert listed == {"id": code["id"], "name": "code", "tokens": code["tokens"], "documents": 4, "vocab_size": 257,
                      "tokenizer": "bytes"}


def test_the_job_page_shows_its_dataset_and_data_progress(browser_client, token_client, code, two_nodes,
                                                          run) -> None:
    job = run(token_client.post, "/api/jobs", {"name": "on-code", "model": "tiny-gpt", "gpus": 1, "seq_len": 16,
                                               "global_batch": 4, "dataset": "code"}, format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    run(job_record_report, report=report_of(job["id"], "step", "node-1", step=5, loss=3.0))
    html = browser_client.get(f"/jobs/{job['id']}/").content.decode()
    assert 'data <a href="/datasets/#dataset-code">code</a>' in html and 'id="job-data-progress"' in html
    data = embedded_json(html, "job-data")
    assert data["dataset"] == {"id": code["id"], "name": "code"}
    assert data["samples_per_epoch"] == job["data_progress"]["samples_per_epoch"] > 0
    assert browser_client.get(f"/jobs/{job['id']}/state.json").json()["dataset"]["name"] == "code"
    synthetic = run(token_client.post, "/api/jobs", {"name": "plain", "model": "tiny-gpt", "gpus": 1,
                                                     "start": False}, format="json").json()
    html = browser_client.get(f"/jobs/{synthetic['id']}/").content.decode()
    assert '<span id="job-dataset">synthetic tokens</span>' in html
    assert embedded_json(html, "job-data")["dataset"] is None


NODE = shutil.which("node")
RUNNER = """
import { dataProgress } from "%s";
let input = "";
process.stdin.on("data", (d) => { input += d; });
process.stdin.on("end", () => {
  process.stdout.write(JSON.stringify(JSON.parse(input).map((c) => dataProgress(c.step, c.global_batch, c.seq_len,
                                                                                c.samples_per_epoch))));
});
"""


@pytest.mark.skipif(NODE is None, reason="node is not installed")
@pytest.mark.django_db(False)
def test_the_page_counts_data_progress_as_the_api_does(tmp_path) -> None:
    rng = random.Random(42)
    cases = [{"step": rng.choice([None, 0, rng.randint(1, 10**6)]), "global_batch": rng.randint(1, 4096),
              "seq_len": rng.randint(1, 65536), "samples_per_epoch": rng.choice([None, rng.randint(1, 10**9)])}
             for _ in range(200)]
    script = tmp_path / "runner.mjs"
    script.write_text(RUNNER % STORE.as_uri())
    out = subprocess.run([NODE, str(script)], input=json.dumps(cases), capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    for case, js in zip(cases, got):
        py = data_progress(**case)
        assert {k: v for k, v in js.items() if k != "epoch"} == {k: v for k, v in py.items() if k != "epoch"}
        assert js["epoch"] == pytest.approx(py["epoch"]) if py["epoch"] is not None else js["epoch"] is None
