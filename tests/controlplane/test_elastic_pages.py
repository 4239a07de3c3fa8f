"""The elastic scheduler in the pages (issue 31), from real rows: the elastic page embeds
GET /api/elastic's answer and the cluster timeline built from the layout history; the job
page's row carries the switch, the range and the priority; the jobs list shows the range
(an empty bound as the job's size) and the New job form has the fields."""
from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.jobs.models import Job, Transition
from controlplane.jobs.reports import job_record_report
from frontend.elastic_text import range_text
from tests.controlplane.conftest import embedded_json
from tests.support.reports import report_of

pytestmark = pytest.mark.django_db

SHRINK = "shrank to 1 (dp=1): job 'eval' (priority 10) needed 4 GPUs"


@pytest.fixture
def elastic_job(run, token_client, two_nodes, sent_tasks) -> dict:
    """A running elastic job on 2 GPUs (range 1 to 4, priority 3)."""
    job = run(token_client.post, "/api/jobs", {"name": "stretchy", "model": "tiny-gpt", "gpus": 2, "global_batch": 12,
                                               "elastic": True, "min_gpus": 1, "max_gpus": 4, "priority": 3},
              format="json").json()
    run(job_record_report, report=report_of(job["id"], "started", "node-1"))
    return job


def test_the_pages_need_a_signed_in_user() -> None:
    for path in ("/elastic/", "/elastic/timeline.json"):
        response = Client().get(path)
        assert response.status_code == 302 and "/accounts/login/" in response["Location"], path


def test_the_elastic_page_embeds_the_plan_with_a_pending_start_and_its_reason(run, browser_client, token_client,
                                                                               elastic_job) -> None:
    queued = run(token_client.post, "/api/jobs", {"name": "urgent", "model": "tiny-gpt", "gpus": 2, "queue": True,
                                                  "priority": 9}, format="json").json()
    response = browser_client.get("/elastic/")
    assert response.status_code == 200
    html = response.content.decode()
    plan = embedded_json(html, "elastic-plan")
    api = token_client.get("/api/elastic").json()  # the page embeds what the API says
    assert (plan["jobs"], plan["decisions"], plan["waiting"]) == (api["jobs"], api["decisions"], api["waiting"])
    jobs = {j["name"]: j for j in plan["jobs"]}
    assert (jobs["stretchy"]["elastic"], jobs["stretchy"]["min_gpus"], jobs["stretchy"]["max_gpus"],
            jobs["stretchy"]["priority"]) == (True, 1, 4, 3)
    assert jobs["urgent"]["queued"] is True
    start = next(d for d in plan["decisions"] if d["job_id"] == queued["id"])
    assert start["kind"] == "start" and start["gpus_to"] == 2 and start["reason"]
    assert '<a href="/elastic/">Elastic</a>' in html  # the nav links the page
    for element in ("decisions-body", "waiting-list", "elastic-timeline", "elastic-jobs-body", "sweep-body"):
        assert f'id="{element}"' in html, element


def test_the_timeline_draws_each_job_from_its_start_through_its_committed_switches(browser_client, elastic_job) -> None:
    started = timezone.now() - timedelta(seconds=120)
    Job.objects.filter(pk=elastic_job["id"]).update(started_at=started)
    job = Job.objects.get(pk=elastic_job["id"])
    committed = Transition.objects.create(
        job=job, source_layout="dp=2", destination_layout="dp=1", source_world=2, destination_world=1,
        state="committed", reason=SHRINK, finished_at=started + timedelta(seconds=30))
    Transition.objects.create(job=job, source_layout="dp=1", destination_layout="dp=4", source_world=1,
                              destination_world=4, state="rolled_back", reason="verification failed",
                              finished_at=started + timedelta(seconds=50))  # never held 4: not drawn
    html = browser_client.get("/elastic/").content.decode()
    figure = embedded_json(html, "elastic-timeline-figure")
    (trace,) = figure["data"]
    assert trace["name"] == "stretchy" and trace["y"][:2] == [2, 1] and set(trace["y"][1:]) == {1}
    marked = [text for text, size in zip(trace["text"], trace["marker"]["size"]) if size]
    assert marked == [f"stretchy: 2 → 1 GPUs (#{committed.pk}, resize)<br>{SHRINK}"]
    # Ended: the job's GPUs drop to 0 at its end.
    Job.objects.filter(pk=job.pk).update(state="stopped", updated_at=started + timedelta(seconds=90))
    stopped = browser_client.get("/elastic/timeline.json").json()["data"][0]
    assert stopped["y"][-2:] == [0, 0] and stopped["text"][-2] == "stretchy: ended, its GPUs freed"


def test_an_empty_cluster_timeline_says_no_data_yet(browser_client) -> None:
    figure = browser_client.get("/elastic/timeline.json").json()
    assert figure["data"] == [] and [a["text"] for a in figure["layout"]["annotations"]] == ["no data yet"]
    html = browser_client.get("/elastic/").content.decode()
    assert embedded_json(html, "elastic-plan")["decisions"] == []


def test_the_job_page_carries_the_switch_range_and_priority(browser_client, token_client, elastic_job) -> None:
    html = browser_client.get(f"/jobs/{elastic_job['id']}/").content.decode()
    data = embedded_json(html, "job-data")
    assert {k: data[k] for k in ("elastic", "min_gpus", "max_gpus", "priority", "world_size")} == \
        {"elastic": True, "min_gpus": 1, "max_gpus": 4, "priority": 3, "world_size": 2}
    for element in ("elastic-card", "elastic-toggle", "elastic-range", "elastic-pending", "elastic-dialog"):
        assert f'id="{element}"' in html, element
    # The switch the card PATCHes: the page's session (CSRF) through the API.
    client = Client(enforce_csrf_checks=True)
    client.force_login(Job.objects.get(pk=elastic_job["id"]).created_by)
    page = client.get(f"/jobs/{elastic_job['id']}/")
    token = page.cookies["csrftoken"].value
    url = f"/api/jobs/{elastic_job['id']}/elastic"
    assert client.patch(url, {"elastic": False}, content_type="application/json").status_code == 403  # no token
    off = client.patch(url, {"elastic": False}, content_type="application/json", HTTP_X_CSRFTOKEN=token)
    assert off.status_code == 200 and off.json()["elastic"] is False
    assert browser_client.get(f"/jobs/{elastic_job['id']}/state.json").json()["elastic"] is False


def test_the_job_page_edits_the_range_and_priority_with_the_apis_words(browser_client, elastic_job) -> None:
    html = browser_client.get(f"/jobs/{elastic_job['id']}/").content.decode()
    form = html.split('id="elastic-form"')[1].split("</form>")[0]
    ids = re.findall(r'\sid="([^"]+)"', html)
    assert len(ids) == len(set(ids)), sorted(i for i in set(ids) if ids.count(i) > 1)  # labels find their fields
    for field in ("min_gpus", "max_gpus", "priority"):  # each field with its error box beside it
        assert f'id="elastic-set-{field}" name="{field}"' in form
        assert f'aria-describedby="elastic-error-{field}"' in form
        assert f'id="elastic-error-{field}"' in form, field
    # What the form sends (strings from the inputs, null for an empty bound) and what it shows
    # beside a field when the API refuses: the body's words for that field.
    url = f"/api/jobs/{elastic_job['id']}/elastic"
    refused = browser_client.patch(url, {"min_gpus": "3", "max_gpus": None, "priority": "2"},
                                   content_type="application/json")
    assert refused.status_code == 400
    assert refused.json()["min_gpus"] == [
        "min_gpus=3 is above the 2 GPUs the job runs on (world_size); the range must hold them"]
    assert browser_client.patch(url, {"min_gpus": "1", "max_gpus": "2", "priority": ""},
                                content_type="application/json").json()["priority"] == ["A valid integer is required."]
    saved = browser_client.patch(url, {"min_gpus": None, "max_gpus": "4", "priority": "-1"},
                                 content_type="application/json")
    assert saved.status_code == 200
    assert {k: saved.json()[k] for k in ("min_gpus", "max_gpus", "priority")} == {
        "min_gpus": None, "max_gpus": 4, "priority": -1}


def test_the_jobs_list_shows_each_range_with_empty_bounds_as_the_size(run, browser_client, token_client,
                                                                      elastic_job) -> None:
    run(token_client.post, "/api/jobs", {"name": "rigid", "model": "tiny-gpt", "gpus": 2, "start": False,
                                         "priority": -2}, format="json")
    html = browser_client.get("/jobs/").content.decode()
    # (both columns sort like the others: a header button, in the address as ?sort=elastic / ?sort=priority)
    assert 'class="sort" data-sort="elastic">Elastic range</button></th>' in html
    assert 'class="sort" data-sort="priority">Priority</button></th>' in html
    stretchy = html.split('data-job="stretchy"')[1].split("</tr>")[0]
    assert 'data-elastic="true" data-min="1" data-max="4"' in stretchy and "on</span> 1–4 GPUs</td>" in stretchy
    assert '<td data-field="priority">3</td>' in stretchy
    rigid = html.split('data-job="rigid"')[1].split("</tr>")[0]
    assert 'data-elastic="false" data-min="" data-max=""' in rigid
    assert "off</span> 2 GPUs (follows the current size)</td>" in rigid and '<td data-field="priority">-2</td>' in rigid
    for field in ("elastic", "min_gpus", "max_gpus", "priority"):  # the New job form's fields and their error boxes
        assert f'id="job-{field}"' in html and f'id="error-{field}"' in html, field


def test_the_list_marks_a_queued_job_and_the_stream_carries_its_settings(run, browser_client, token_client,
                                                                         elastic_job, sent_events) -> None:
    sent_events.clear()
    queued = run(token_client.post, "/api/jobs", {"name": "urgent", "model": "tiny-gpt", "gpus": 2, "queue": True,
                                                  "priority": 9}, format="json").json()
    run(token_client.patch, f"/api/jobs/{elastic_job['id']}/elastic", {"min_gpus": 2, "priority": 7}, format="json")
    html = browser_client.get("/jobs/").content.decode()
    urgent = html.split('data-job="urgent"')[1].split("</tr>")[0]
    assert 'data-queued="true"' in urgent and '<span class="queued" data-field="queued">queued</span>' in urgent
    assert 'data-field="queued"' not in html.split('data-job="stretchy"')[1].split("</tr>")[0]
    # What the list's live cells are drawn from: the cluster stream's job events.
    jobs = [e.job for e in sent_events if getattr(e, "type", None) == "job"]
    assert (jobs[0].name, jobs[0].queued, jobs[0].priority, jobs[0].elastic) == ("urgent", True, 9, False)
    assert (jobs[-1].id, jobs[-1].elastic, jobs[-1].min_gpus, jobs[-1].max_gpus, jobs[-1].priority) == (
        elastic_job["id"], True, 2, 4, 7)
    assert queued["queued"] is True


@pytest.mark.parametrize("bounds, world, text", [
    ((None, None), 2, "2 GPUs (follows the current size)"),
    ((1, None), 2, "1–2 GPUs (max follows the current size)"),
    ((None, 8), 4, "4–8 GPUs (min follows the current size)"),
    ((1, 1), 1, "1 GPU"),
    ((2, 4), 3, "2–4 GPUs"),
])
def test_range_text(bounds, world, text) -> None:
    assert range_text(*bounds, world) == text


def test_the_form_posts_what_the_api_checks(token_client, two_nodes) -> None:
    """The fields the New job form sends, and the refusals it places beside them."""
    body = {"name": "f", "model": "tiny-gpt", "gpus": 2, "elastic": True, "min_gpus": 3, "max_gpus": 2,
            "priority": 1, "start": False}
    refused = token_client.post("/api/jobs/validate", body, format="json")
    assert refused.status_code == 400
    assert set(refused.json()) <= {"min_gpus", "max_gpus"} and refused.json()
