"""Rank 0's log tail on the control plane: the control.job_log task (validation), the
stored tail and its `log` event on the job's stream, GET /api/jobs/{id}/log (bounded,
hostile input as 400s naming the field), and the job page's panel data."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from agents import protocol
from controlplane.jobs import tasks
from controlplane.jobs.events import JobLiveSnapshot, LogEvent, apply_job_event, job_event_adapter
from controlplane.jobs.job_logs import job_log_record
from controlplane.jobs.models import Job, JobLog
from tests.controlplane.conftest import embedded_json

pytestmark = pytest.mark.django_db


def _job(run, token_client) -> dict:
    """A pending job whose ranks are placed on node-1, as a start would place them: its log tails
    are heard from node-1 only (jobs/job_speakers.py)."""
    response = run(token_client.post, "/api/jobs", {"name": "logged", "model": "tiny-gpt", "gpus": 2, "start": False},
                   format="json")
    assert response.status_code == 201, response.content
    Job.objects.filter(pk=response.json()["id"]).update(
        placement=[{"rank": rank, "node": "node-1", "gpu": rank} for rank in (0, 1)])
    return response.json()


def _tail(job_id: int, lines, *, at: datetime | None = None, finished: bool = False) -> protocol.JobLogTail:
    return protocol.JobLogTail(job_id=job_id, node="node-1", rank=0, lines=tuple(lines), truncated=False,
                               finished=finished, sent_at=at or datetime.now(timezone.utc))


def test_a_tail_is_stored_sent_to_the_page_and_read_back(run, token_client, two_nodes, sent_events) -> None:
    job = _job(run, token_client)
    empty = token_client.get(f"/api/jobs/{job['id']}/log").json()
    assert empty == {"job": job["id"], "node": None, "rank": 0, "lines": [], "truncated": False, "finished": False,
                     "sent_at": None}
    lines = [f"line {i}" for i in range(12)] + ["RuntimeError: boom"]
    sent_events.clear()
    assert run(job_log_record, report=_tail(job["id"], lines)) is True
    body = token_client.get(f"/api/jobs/{job['id']}/log").json()
    assert body["lines"] == lines and body["node"] == "node-1" and body["sent_at"]
    events = [e for e in sent_events if isinstance(e, LogEvent)]
    assert len(events) == 1 and list(events[0].log.lines) == lines
    # The event on the wire is the closed schema; the live snapshot only moves on with it.
    wire = job_event_adapter.validate_python(events[0].model_dump(mode="json"))
    before = JobLiveSnapshot(seq=wire.seq - 1, metrics={})
    assert apply_job_event(before, wire) == JobLiveSnapshot(seq=wire.seq, metrics={})
    last = token_client.get(f"/api/jobs/{job['id']}/log?lines=3").json()
    assert last["lines"] == lines[-3:] and last["truncated"] is True


def test_an_older_or_unchanged_tail_changes_nothing_and_a_gone_job_is_dropped(run, token_client, two_nodes,
                                                                               sent_events) -> None:
    job = _job(run, token_client)
    now = datetime.now(timezone.utc)
    assert run(job_log_record, report=_tail(job["id"], ["new"], at=now)) is True
    sent_events.clear()
    assert run(job_log_record, report=_tail(job["id"], ["old"], at=now - timedelta(seconds=1))) is False
    assert run(job_log_record, report=_tail(job["id"], ["new"], at=now + timedelta(seconds=1))) is False
    assert JobLog.objects.get(job_id=job["id"]).lines == ["new"] and sent_events == []
    assert run(job_log_record, report=_tail(job["id"], ["new", "last"], at=now + timedelta(seconds=2),
                                            finished=True)) is True
    assert token_client.get(f"/api/jobs/{job['id']}/log").json()["finished"] is True
    assert run(job_log_record, report=_tail(job["id"] + 100, ["x"])) is False
    run(token_client.delete, f"/api/jobs/{job['id']}")
    assert not JobLog.objects.exists()  # deleted with its job


def test_the_task_refuses_a_tail_beyond_the_bounds(run, token_client, two_nodes, caplog) -> None:
    job = _job(run, token_client)
    wire = _tail(job["id"], ["fine"]).model_dump(mode="json")
    for bad in ({"lines": ["x"] * 51}, {"lines": ["y" * 401]}, {"lines": ["a\nb"]}, {"surprise": True}):
        run(tasks.job_log, {**wire, **bad})
    run(tasks.job_log, {**wire, "node": "/etc"})  # no agent can be enrolled as that: unsealed
    assert not JobLog.objects.exists()
    assert caplog.text.count("rejected log tail of job") == 4
    assert "refused control.job_log from an unsealed sender" in caplog.text
    run(tasks.job_log, wire)
    assert JobLog.objects.get().lines == ["fine"]


@pytest.mark.parametrize("query", ["?lines=0", "?lines=51", "?lines=-1", "?lines=x", "?lines=", "?lines=²",
                                   "?lines=99999999999999999999"])
def test_a_bad_line_count_is_a_400_naming_it(run, token_client, two_nodes, query) -> None:
    job = _job(run, token_client)
    response = token_client.get(f"/api/jobs/{job['id']}/log{query}")
    assert response.status_code == 400 and "lines must be an integer from 1 to 50" in response.json()["lines"][0]


def test_the_log_of_no_job_is_a_404(token_client, two_nodes) -> None:
    response = token_client.get("/api/jobs/999/log")
    assert response.status_code == 404 and "/" not in response.json()["detail"].replace("N/A", "")


def test_the_job_page_embeds_the_log_and_its_panel(run, token_client, two_nodes, browser_client) -> None:
    job = _job(run, token_client)
    run(job_log_record, report=_tail(job["id"], ["rank 0: training dp=2 on 2 ranks, ready in 3.1 s"]))
    html = browser_client.get(f"/jobs/{job['id']}/").content.decode()
    assert embedded_json(html, "job-log-data")["lines"] == ["rank 0: training dp=2 on 2 ranks, ready in 3.1 s"]
    assert 'id="job-log"' in html and 'role="log"' in html and "only errors and warnings" in html
