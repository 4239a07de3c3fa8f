"""The job pages render from real rows (PostgreSQL or SQLite): jobs list, job page with its
embedded snapshot and figures, the JSON pieces it fetches, and a transition's page."""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
from django.test import Client

from agents import protocol
from tests.support.reports import report_of
from controlplane.jobs.reports import job_record_report
from tests.controlplane.conftest import embedded_json

pytestmark = pytest.mark.django_db






@pytest.fixture
def running_job(run, token_client, two_nodes, sent_tasks) -> dict:
    response = run(token_client.post, "/api/jobs", {"name": "paged", "model": "tiny-gpt", "gpus": 2,
                                                    "global_batch": 12}, format="json")
    job = response.json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    return job


def test_pages_need_a_signed_in_user(running_job) -> None:
    for path in ("/jobs/", f"/jobs/{running_job['id']}/", f"/jobs/{running_job['id']}/state.json"):
        response = Client().get(path)
        assert response.status_code == 302 and "/accounts/login/" in response["Location"], path


def test_jobs_list_links_each_job(browser_client, running_job, run) -> None:
    html = browser_client.get("/jobs/").content.decode()
    assert f'href="/jobs/{running_job["id"]}/"' in html and "dp=2" in html
    assert '<td data-field="loss">–</td>' in html  # no step reported yet
    for step, loss in ((1, 5.25), (2, 4.125)):
        run(job_record_report, report=report_of(running_job["id"], "step", step=step, loss=loss, step_seconds=0.5))
    html = browser_client.get("/jobs/").content.decode()
    assert 'data-step="2">2</td>' in html and '<td data-field="loss">4.1250</td>' in html  # the latest
    assert sorted(embedded_json(html, "live-states")) == ["restoring", "running", "starting", "stopping", "switching"]


def test_job_page_embeds_its_snapshot_layout_and_figures(browser_client, running_job) -> None:
    response = browser_client.get(f"/jobs/{running_job['id']}/")
    assert response.status_code == 200
    html = response.content.decode()
    job = embedded_json(html, "job-data")
    assert job["layout"] == "dp=2" and [r["label"] for r in job["ranks"]] == ["pp0 dp0 tp0", "pp0 dp1 tp0"]
    assert embedded_json(html, "job-live")["transitions"] == []
    figures = embedded_json(html, "job-figures")
    assert sorted(figures) == ["loss", "step_seconds", "tokens_per_second"]
    # No step yet: every chart says so (the layout band and its label come with the first step).
    assert all([a["text"] for a in figures[name]["layout"]["annotations"]] == ["no data yet"] for name in figures)
    assert 'max="4"' in html  # the stepper stops at the cluster's GPU count
    assert browser_client.get("/jobs/99999/").status_code == 404


def test_plan_figures_json_and_its_error(browser_client, running_job) -> None:
    body = browser_client.get(f"/jobs/{running_job['id']}/plan-figures.json?layout=dp=4").json()
    assert body["summary"]["src"] == "dp=2" and body["summary"]["dst"] == "dp=4"
    assert {"heatmap", "rounds", "wave"} <= set(body)
    bad = browser_client.get(f"/jobs/{running_job['id']}/plan-figures.json?layout=tp=3")
    assert bad.status_code == 400 and "cannot be planned" in bad.json()["error"]
    assert browser_client.get(f"/jobs/{running_job['id']}/plan-figures.json").status_code == 400


def test_transition_page_after_a_resize(run, token_client, browser_client, running_job) -> None:
    transition = run(token_client.post, f"/api/jobs/{running_job['id']}/resize", {"gpus": 4}, format="json").json()
    state = browser_client.get(f"/jobs/{running_job['id']}/state.json").json()
    assert state["state"] == "switching"
    html = browser_client.get(f"/transitions/{transition['id']}/").content.decode()
    assert "dp=2 → dp=4" in html and 'data-verified="unknown"' in html and "planned" in html
    figures = embedded_json(html, "plan-figures")
    assert figures["summary"]["fingerprint"] == transition["plan_fingerprint"]
    job_page = browser_client.get(f"/jobs/{running_job['id']}/").content.decode()
    assert embedded_json(job_page, "job-live")["transitions"][0]["state"] == "planned"


def _report(transition: dict, state: str, **fields) -> protocol.TransitionReport:
    return protocol.TransitionReport(job_id=transition["job_id"], transition_id=transition["id"], node="node-1",
                                     state=state, sent_at=datetime.now(timezone.utc), **fields)


def test_transition_pages_draw_the_measured_waves_and_list_the_tensor_checks(run, token_client, browser_client,
                                                                             running_job) -> None:
    from controlplane.jobs.reports import transition_record_report

    transition = run(token_client.post, f"/api/jobs/{running_job['id']}/resize", {"gpus": 4}, format="json").json()
    run(transition_record_report, report=_report(transition, "transferring", step=4, progress=protocol.TransferProgress(
        round=1, rounds=3, moved_bytes=4096, waves={0: [100, 150, 90]})))
    live = browser_client.get(f"/transitions/{transition['id']}/wave.json").json()
    assert live["progress"]["round"] == 1 and live["progress"]["rounds"] == 3
    measured = [t for t in live["wave"]["data"] if t["name"] == "rank 0 measured"]
    assert len(measured) == 1 and measured[0]["y"] == [100, 150, 90]
    html = browser_client.get(f"/transitions/{transition['id']}/").content.decode()
    assert "round 1 of 3" in html

    rows = [{"name": "embed.weight", "shape": [256, 64], "match": True, "mismatched": [], "digest": "0a"},
            {"name": "layers.0.attn.qkv", "shape": [64, 192], "match": False, "mismatched": ["master"], "digest": "0b"}]
    run(transition_record_report, report=_report(transition, "rolled_back", tensors=rows,
                                                 error="verification failed for 1 tensor states"))
    html = browser_client.get(f"/transitions/{transition['id']}/").content.decode()
    assert 'data-verified="false"' in html and "1 did NOT match" in html
    assert "<details id=\"tensor-checks\" open>" in html  # a failure opens the table
    failed = html.index('class="failed"')
    assert html.index('data-name="layers.0.attn.qkv"') < failed < html.index('data-name="embed.weight"')
    assert "MISMATCH: master" in html


def test_a_restore_row_has_no_routing_plan(browser_client, token_client, running_job) -> None:
    from controlplane.jobs.models import Transition

    restore = Transition.objects.create(job_id=running_job["id"], kind="restore", source_layout="dp=2",
                                        destination_layout="dp=2", state="committed", reason="node-1 lost")
    html = browser_client.get(f"/transitions/{restore.pk}/").content.decode()
    assert 'id="no-plan"' in html and "node-1 lost" in html and 'id="plan-figures"' not in html
    response = token_client.get(f"/api/transitions/{restore.pk}/plan")
    assert response.status_code == 400 and "restore from a checkpoint" in str(response.json())
