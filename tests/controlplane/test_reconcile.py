"""Issue 11, items 1 and 5: what the database believes is settled against what the agents'
heartbeats say they run (controlplane/jobs/reconcile.py, emulation services). Real
database; the agents are their heartbeats, sent with chosen contents and times."""
from __future__ import annotations

from datetime import timedelta

import pytest

from agents import protocol
from controlplane.cluster import services as cluster
from controlplane.emulation.models import EmulationRun
from controlplane.emulation.services import emulations_reconcile
from controlplane.jobs import reconcile, scheduling
from controlplane.jobs.models import Job
from controlplane.jobs.reconcile import GRACE, Seen, unseen
from controlplane.jobs.reports import job_record_report
from tests.controlplane.conftest import heartbeat
from tests.controlplane.test_jobs_restore import gpu_states, make_report

pytestmark = pytest.mark.django_db


def test_the_rule_waits_for_every_node_to_report_after_the_grace() -> None:
    from django.utils import timezone

    t = timezone.now()
    late = t + GRACE + timedelta(seconds=1)
    quiet = {"a": Seen(True, late, frozenset()), "b": Seen(True, late, frozenset())}
    assert unseen(["a", "b"], t, 7, quiet)
    assert not unseen(["a", "b"], t, 7, {**quiet, "b": Seen(True, late, frozenset({7}))})  # b runs it
    assert not unseen(["a", "b"], t, 7, {**quiet, "b": Seen(True, t + timedelta(seconds=2), frozenset())})  # too soon
    assert not unseen(["a", "b"], t, 7, {**quiet, "b": Seen(False, late, frozenset())})  # lost: node_loss's case
    assert not unseen(["a", "c"], t, 7, quiet)  # c never reported
    assert not unseen([], t, 7, quiet)


def _beat(node: str, job: Job | None, at, **extra) -> None:
    jobs = (protocol.RunningJob(job_id=job.pk, ranks=(0, 1)),) if job is not None else ()
    cluster.node_record_heartbeat(report=heartbeat(node, gpus=2, host=f"host-{node[-1]}", jobs=jobs, **extra),
                                  received_at=at)


def _running(run, token_client, name: str, **body) -> Job:
    response = run(token_client.post, "/api/jobs", {"name": name, "model": "tiny-gpt", "gpus": 2,
                                                    "global_batch": 4, **body}, format="json")
    assert response.status_code == 201, response.content
    job = Job.objects.get(name=name)
    run(job_record_report, report=make_report(job, "started", node=job.placement[0]["node"]))
    job.refresh_from_db()
    return job


def test_a_running_job_no_agent_runs_is_restored_or_failed_and_a_stopping_one_stops(two_nodes, token_client,
                                                                                       sent_tasks, run) -> None:
    kept = _running(run, token_client, "kept", checkpoint_interval=0)   # node-1 (both GPUs)
    gone = _running(run, token_client, "gone", checkpoint_interval=0)   # node-2
    later = max(kept.updated_at, gone.updated_at) + GRACE + timedelta(seconds=1)
    _beat("node-1", kept, later)  # node-1 still runs its ranks; node-2's agent restarted: nothing
    _beat("node-2", None, later)
    assert run(reconcile.jobs_reconcile) == [(gone.pk, "failed")]
    gone.refresh_from_db()
    kept.refresh_from_db()
    assert (kept.state, gone.state) == ("running", "failed")
    assert gone.error.startswith("no rank process of the job runs on its nodes (node-2) any more")
    assert "no checkpoint" in gone.error
    assert {k: v for k, v in gpu_states().items() if k.startswith("node-2")} == {
        "node-2/0": ("free", None), "node-2/1": ("free", None)}

    run(scheduling.job_stop, job_id=kept.pk)
    kept.refresh_from_db()
    assert kept.state == "stopping"
    _beat("node-1", kept, kept.updated_at + GRACE + timedelta(seconds=1))  # the ranks still finish their step
    assert run(reconcile.jobs_reconcile) == []
    _beat("node-1", None, kept.updated_at + GRACE + timedelta(seconds=2))  # stopped, but its report was lost
    assert run(reconcile.jobs_reconcile) == [(kept.pk, "stopped")]
    kept.refresh_from_db()
    assert kept.state == "stopped" and all(state == "free" for state, _ in gpu_states().values())


def test_a_job_with_a_checkpoint_is_restored_from_it(two_nodes, token_client, sent_tasks, run) -> None:
    job = _running(run, token_client, "ckpt", checkpoint_interval=5)
    run(job_record_report, report=make_report(job, "checkpoint", node=job.placement[0]["node"], step=5,
                                              checkpoint_path="/ckpt/step-00000005", seconds=0.1))
    job.refresh_from_db()
    later = job.updated_at + GRACE + timedelta(seconds=1)
    for node in ("node-1", "node-2"):
        _beat(node, None, later)
    assert run(reconcile.jobs_reconcile) == [(job.pk, "restoring")]
    job.refresh_from_db()
    assert job.state == "restoring" and "restoring from checkpoint step 5" in job.error
    assert [name for name, _, _ in sent_tasks if name == protocol.CONTROL_JOB_RESTORE]


def test_an_emulation_run_no_agent_works_on_fails(two_nodes, run) -> None:
    from django.utils import timezone

    mine = EmulationRun.objects.create(model="tiny-gpt", layout="dp=1", gpus=1, global_batch=1, seq_len=8,
                                       state=EmulationRun.State.RUNNING)
    other = EmulationRun.objects.create(model="tiny-gpt", layout="dp=1", gpus=1, global_batch=1, seq_len=8,
                                        state=EmulationRun.State.RUNNING)
    queued = EmulationRun.objects.create(model="tiny-gpt", layout="dp=1", gpus=1, global_batch=1, seq_len=8)
    later = timezone.now() + timedelta(seconds=30)
    _beat("node-1", None, later, emulations=(mine.pk,))
    _beat("node-2", None, later)
    assert run(emulations_reconcile) == [other.pk]
    states = dict(EmulationRun.objects.values_list("pk", "state"))
    assert (states[mine.pk], states[other.pk], states[queued.pk]) == ("running", "failed", "queued")
    assert "no agent works on it" in EmulationRun.objects.get(pk=other.pk).error


def test_a_resizing_job_whose_ranks_are_all_gone_is_settled_without_waiting_for_the_resize_timeout(
        two_nodes, token_client, sent_tasks, run) -> None:
    """The whole stack restarted during a resize: no report will ever come for it, so the
    resize's own timeout (minutes) would leave the job `switching`. The reconciliation
    aborts the resize with the reason and restores the job from its checkpoint; while any
    of its nodes, the joining one included, still runs a rank, nothing happens."""
    from controlplane.jobs.models import Transition
    from controlplane.jobs.timeouts import last_moved

    job = _running(run, token_client, "resizing", checkpoint_interval=5)  # node-1
    run(job_record_report, report=make_report(job, "checkpoint", node="node-1", step=5,
                                              checkpoint_path="/ckpt/step-00000005", seconds=0.1))
    response = run(token_client.post, f"/api/jobs/{job.pk}/resize", {"gpus": 4}, format="json")
    assert response.status_code == 202, response.content
    resize = Transition.objects.get(pk=response.json()["id"])
    job.refresh_from_db()
    assert job.state == "switching" and {s["node"] for s in resize.destination_placement} == {"node-1", "node-2"}
    later = max(job.updated_at, last_moved(resize)) + GRACE + timedelta(seconds=1)
    _beat("node-1", None, later)
    _beat("node-2", job, later)  # a joining rank still runs on node-2
    assert run(reconcile.jobs_reconcile) == []
    _beat("node-2", None, later + timedelta(seconds=2))
    assert run(reconcile.jobs_reconcile) == [(job.pk, "restoring")]
    job.refresh_from_db()
    resize.refresh_from_db()
    assert job.state == "restoring" and "restoring from checkpoint step 5" in job.error
    assert resize.state == "aborted"
    assert "; ranks lost while the resize was planned: no rank process of the job runs on " \
           "its nodes (node-1, node-2) any more" in resize.reason


def test_the_sweep_reads_many_live_jobs_in_a_fixed_number_of_queries(two_nodes, token_client, sent_tasks,
                                                                        run) -> None:
    """The sweep runs every 5 s over every live job: at 200 jobs a few queries per job held a
    worker thread for seconds (benchmarks/cluster_scale.py). Jobs that their nodes run cost none."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    jobs = [_running(run, token_client, f"j{i}", gpus=1, checkpoint_interval=0) for i in range(4)]
    later = max(job.updated_at for job in jobs) + GRACE + timedelta(seconds=1)
    for node in ("node-1", "node-2"):
        ranks = tuple(protocol.RunningJob(job_id=job.pk, ranks=(0,)) for job in jobs
                      if job.placement[0]["node"] == node)
        cluster.node_record_heartbeat(report=heartbeat(node, gpus=2, host=f"host-{node[-1]}", jobs=ranks),
                                      received_at=later)
    with CaptureQueriesContext(connection) as few:
        assert run(reconcile.jobs_reconcile) == []
    assert len(few.captured_queries) <= 3  # (nodes, jobs, their transitions; was 2 + 2 a job)
