"""The control plane's timeout for a stuck resize (controlplane/jobs/timeouts.py): a resize
no report has moved for DYNAPLANE_TRANSITION_TIMEOUT_SECONDS is aborted with a cancel to
the nodes (before the state moves) or ends with the job restored from its checkpoint or
failed (after), saying why.

Real PostgreSQL (or SQLite) and Redis; only the control plane's Celery send_task is
replaced, by a recorder, since no agent runs here. Time is passed in (`now`), not waited for.
"""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone as dj_timezone

from agents import protocol
from controlplane.jobs.lifecycle import TransitionState
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.reports import job_record_report
from controlplane.jobs.tasks import transition_report
from controlplane.jobs.timeouts import TimeoutOutcome, timeout_outcome, transitions_time_out
from tests.controlplane.test_jobs_resize import gpu_states, resize_job, running_job, treport
from tests.controlplane.test_jobs_restore import make_report

pytestmark = pytest.mark.django_db
TIMEOUT = timedelta(seconds=600)


def _later(seconds: float):
    return dj_timezone.now() + timedelta(seconds=seconds)


def _stuck_resize(run, token_client, *states: str, **job_fields) -> tuple[Job, Transition]:
    job = running_job(run, token_client, layout="dp=2", **job_fields)  # node-1
    t = Transition.objects.get(pk=resize_job(run, token_client, job, gpus=4).json()["id"])  # ranks 2, 3 on node-2
    for state in states:
        run(transition_report, treport(t, state, step=5))
    return job, t


def test_the_rule_aborts_before_the_state_moves_and_recovers_after() -> None:
    assert [timeout_outcome(s) for s in (TransitionState.PLANNED, TransitionState.PREPARING)] == [
        TimeoutOutcome.ABORT] * 2
    assert [timeout_outcome(s) for s in (TransitionState.READY, TransitionState.TRANSFERRING,
                                         TransitionState.VERIFYING)] == [TimeoutOutcome.RECOVER] * 3
    for state in (TransitionState.COMMITTED, TransitionState.ABORTED, TransitionState.ROLLED_BACK):
        with pytest.raises(ValueError, match="cannot time out"):
            timeout_outcome(state)
    assert settings.DYNAPLANE_TRANSITION_TIMEOUT_SECONDS == 600


def test_a_resize_stuck_preparing_is_aborted_and_the_nodes_told(two_nodes, token_client, sent_tasks, run) -> None:
    job, t = _stuck_resize(run, token_client, "preparing")
    assert run(transitions_time_out, timeout=TIMEOUT, now=_later(599)) == []  # not yet
    t.refresh_from_db()
    assert t.state == "preparing"
    sent_tasks.clear()
    assert run(transitions_time_out, timeout=TIMEOUT, now=_later(601)) == [t.pk]
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted" and [h["state"] for h in t.history][-1] == "aborted"
    assert ("no report from the ranks for 600 s while the resize was preparing "
            "(DYNAPLANE_TRANSITION_TIMEOUT_SECONDS): aborted by the control plane; the job trains on in dp=2") in t.reason
    assert (job.state, job.layout, job.world_size) == ("running", "dp=2", 2)
    assert gpu_states() == {"node-1/0": ("allocated", "j"), "node-1/1": ("allocated", "j"),
                       "node-2/0": ("free", None), "node-2/1": ("free", None)}
    cancels = {q: protocol.JobSwitchCancel.model_validate(m) for name, m, q in sent_tasks
               if name == protocol.NODE_JOB_SWITCH_CANCEL}
    assert set(cancels) == {"node.node-1", "node.node-2"}  # rank 0's node and the joining ranks'
    assert {c.transition_id for c in cancels.values()} == {t.pk}
    assert run(transitions_time_out, timeout=TIMEOUT, now=_later(1200)) == []  # over: nothing twice
    assert resize_job(run, token_client, job, gpus=3).status_code == 202  # a new resize may follow


def test_a_report_restarts_the_clock(two_nodes, token_client, sent_tasks, run) -> None:
    job, t = _stuck_resize(run, token_client)
    Transition.objects.filter(pk=t.pk).update(history=[{**t.history[0], "at": _later(-700).isoformat()}])
    run(transition_report, treport(t, "preparing"))  # moves it now
    assert run(transitions_time_out, timeout=TIMEOUT, now=_later(10)) == []
    assert Transition.objects.get(pk=t.pk).state == "preparing"


def test_a_resize_stuck_transferring_without_a_checkpoint_fails_the_job(two_nodes, token_client, sent_tasks,
                                                                        run) -> None:
    job, t = _stuck_resize(run, token_client, "preparing", "ready", "transferring", checkpoint_interval=0)
    sent_tasks.clear()
    assert run(transitions_time_out, timeout=TIMEOUT, now=_later(601)) == [t.pk]
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted" and "the job failed while the transition was transferring" in t.reason
    assert job.state == "failed"
    assert job.error == (f"transition {t.pk} stuck: no report from the ranks for 600 s while the resize was "
                         f"transferring (DYNAPLANE_TRANSITION_TIMEOUT_SECONDS); no checkpoint to restore from "
                         f"(checkpoint_interval=0: checkpoints are off)")
    assert {state for state, _ in gpu_states().values()} == {"free"}
    assert {q for name, _, q in sent_tasks if name == protocol.NODE_JOB_STOP} == {"node.node-1", "node.node-2"}


def test_a_resize_stuck_ready_with_a_checkpoint_restores_the_job(two_nodes, token_client, sent_tasks,
                                                                 run) -> None:
    job, t = _stuck_resize(run, token_client, checkpoint_interval=5)
    run(job_record_report, report=make_report(job, "checkpoint", step=5, checkpoint_path="/ckpt/step-00000005"))
    run(transition_report, treport(t, "ready", step=6))
    sent_tasks.clear()
    assert run(transitions_time_out, timeout=TIMEOUT, now=_later(601)) == [t.pk]
    t.refresh_from_db()
    job.refresh_from_db()
    assert t.state == "aborted" and "restoring from checkpoint step 5" in t.reason
    assert job.state == "restoring" and job.error.startswith(f"transition {t.pk} stuck: no report")
    assert [(name, m) for name, m, _ in sent_tasks] == [(protocol.CONTROL_JOB_RESTORE, job.pk)]


def test_the_sweep_task_runs_on_beat() -> None:
    from controlplane.celery import app

    app.loader.import_default_modules()
    assert protocol.CONTROL_SWEEP_STUCK_TRANSITIONS in app.tasks
    assert any(entry["task"] == protocol.CONTROL_SWEEP_STUCK_TRANSITIONS
               for entry in settings.CELERY_BEAT_SCHEDULE.values())
