"""What the agents report about a job's ranks (protocol.JobReport) and its layout switches
(protocol.TransitionReport), applied to the job and its transitions.

started: starting -> running.          step: metrics appended, a live metrics event.
stopped: -> stopped, GPUs released.   failed: -> failed, GPUs released, other nodes stopped.
Reports travel through a thread pool, so they may arrive out of order: a step before its
started moves the job to running as well; a stopped report from a running job (max_steps
reached) goes through stopping. Reports of unknown or finished jobs are logged and
ignored: a late step after a stop must neither fail nor bring the job back.

Transition reports (rank 0): preparing, ready, transferring, [verifying], committed; or
aborted / rolled_back. A report may skip states (e.g. one lost on the way): the
transition walks the forward path through them. A late report (a state the transition
has passed) or a duplicate only fills fields still empty (e.g. prepare_seconds of a
`ready` overtaken by `transferring`); a terminal transition never changes state again.
"""
from __future__ import annotations

import logging

from django.db import transaction
from django.utils import timezone

from agents import protocol
from controlplane.cluster.lifecycle import IllegalTransition
from controlplane.common.events import next_seq, next_seqs_of, publish_many_on_commit, publish_on_commit
from controlplane.jobs import restore, transitions
from controlplane.jobs.events import METRIC_NAMES, METRIC_UNITS, CheckpointEvent, MetricsEvent, job_stream
from controlplane.jobs.lifecycle import (
    LIVE_JOB_STATES,
    TERMINAL_TRANSITION_STATES,
    JobState,
    TransitionKind,
    JobTrigger,
    TransitionState,
    job_next_state,
    restore_next_state,
    transition_forward_path,
    transition_next_state,
)
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.failures import job_finish
from controlplane.jobs.orders import stop_on_commit
from controlplane.jobs.services import jobs_metrics_extend, publish_job
from controlplane.jobs.transfer_progress import merge_progress

log = logging.getLogger(__name__)


def job_record_report(*, report: protocol.JobReport) -> Job | None:
    """Apply one report; returns the job (None when unknown)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=report.job_id).first()
        if job is None:
            log.info("ignored %s report from %s: job %s does not exist", report.kind, report.node, report.job_id)
            return None
        apply_report(job, report)
    return job


def apply_report(job: Job, report: protocol.JobReport) -> None:
    """Apply one report to the locked job: while restoring, the orphaned and failed reports
    of the world that was lost are what the recovery decides on (restore.job_restore);
    otherwise the report's handler, unless it is refused."""
    if recovery_report(job, report):
        return
    why = refusal(job, report)
    if why:
        log.info("ignored %s report from %s: %s", report.kind, report.node, why)
    else:
        HANDLERS[report.kind](job, report)


def recovery_report(job: Job, report: protocol.JobReport) -> bool:
    """Record an orphaned or failed report of a restoring job's lost world (True when it was one)."""
    if not (job.state == JobState.RESTORING and report.restore_id == job.restore_id
            and report.kind in ("orphaned", "failed")):
        return False
    if report.kind == "orphaned":
        restore.restore_record_orphan(job, report)
    else:
        restore.restore_record_lost(job, {report.node})
    return True


def refusal(job: Job, report: protocol.JobReport) -> str:
    """Why a report of the (locked) job is not applied ("" when it is): the job must be
    live and the report come from the world now running."""
    if job.state not in LIVE_JOB_STATES:
        return f"job {job.name} is {job.state}"
    if report.restore_id != job.restore_id and not _trained_before_its_survivors(job, report):
        # from a world the job has left (before a restart from a checkpoint)
        return (f"job {job.name} is {job.state} (restore {job.restore_id}), the report is from restore "
                f"{report.restore_id}")
    if job.state == JobState.RESTORING and report.kind != "step":  # no world runs
        return f"job {job.name} is {job.state}"
    # A step of the world being recovered, reported before its ranks lost their peers, can
    # arrive after another rank's agent said so (rank 0's batch window): it did train, and
    # the survivors go on after it, so refusing it would leave a gap in the job's history.
    return ""


def _trained_before_its_survivors(job: Job, report: protocol.JobReport) -> bool:
    """A step of the world the job's survivors were recovered from, at or before the step they
    hold: rank 0's last batch can arrive after the recovery was planned (a new restore id), and
    the survivors go on after that step, so it belongs to the job's history."""
    if report.kind != "step" or job.restore_id is None:
        return False
    row = Transition.objects.filter(pk=job.restore_id, job=job, kind=TransitionKind.RESTORE).only(
        "step", "verification").first()
    survivors = (row.verification or {}).get("survivors") if row is not None else None
    return (bool(survivors) and "source_restore" in survivors and survivors["source_restore"] == report.restore_id
            and row.step is not None and report.step <= row.step)


def _to_running(job: Job) -> None:
    if job.state == JobState.STARTING:
        job.state = job_next_state(JobState.STARTING, JobTrigger.STARTED)
        job.save(update_fields=["state", "updated_at"])
        publish_job(job, "upsert")


def _started(job: Job, report: protocol.JobStarted) -> None:
    _to_running(job)


def _step(job: Job, report: protocol.JobStepped) -> None:
    if steps(job, [report]):
        job.save(update_fields=["step"])


def steps(job: Job, reports: list[protocol.JobStepped]) -> bool:
    """Apply step reports of the (locked) job, in order: one metrics append and one seq
    allocation for all of them, their events sent as one channel-layer message. True when
    job.step moved on (the caller saves it, with whatever else it changes)."""
    step = job.step
    steps_of_jobs([(job, reports)])
    return job.step != step


def steps_of_jobs(items: list[tuple[Job, list[protocol.JobStepped]]]) -> None:
    """`steps` for several (locked) jobs at once: one metrics append and one seq allocation for
    all of them together, each job's events one channel-layer message. Each job's `step` is
    moved on in memory; the caller saves it."""
    items = [(job, reports) for job, reports in items if reports]
    if not items:
        return
    rows_of, values_of = [], {}
    for job, reports in items:
        _to_running(job)
        top = max(report.step for report in reports)
        if job.step is None or top > job.step:
            job.step = top
        values = values_of[job.pk] = [{name: getattr(report, name) for name in METRIC_NAMES} for report in reports]
        rows_of.append((job, [(float(report.step), {name: value for name, value in row.items() if value is not None})
                              for report, row in zip(reports, values)]))
    jobs_metrics_extend(items=rows_of, units=METRIC_UNITS)
    seqs = next_seqs_of({job_stream(job.pk): len(reports) for job, reports in items})
    for job, reports in items:
        stream = job_stream(job.pk)
        events = [MetricsEvent(seq=seq, job=job.pk, step=report.step, **row)
                  for seq, report, row in zip(seqs[stream], reports, values_of[job.pk])]
        if len(events) == 1:
            publish_on_commit(stream, events[0])
        else:
            publish_many_on_commit(stream, events)


def _stopped(job: Job, report: protocol.JobStopped) -> None:
    state = JobState(job.state)
    if state is not JobState.STOPPING:  # max_steps reached, or the order raced the report
        state = job_next_state(state, JobTrigger.STOP)
    job_finish(job, state=job_next_state(state, JobTrigger.STOPPED))


def _checkpoint(job: Job, report: protocol.JobCheckpointed) -> None:
    """A periodic checkpoint is complete: the latest one is what a restore loads."""
    if job.checkpoint_step is not None and report.step <= job.checkpoint_step:
        return  # late: a newer one is known
    job.checkpoint_step, job.checkpoint_path = report.step, report.checkpoint_path
    job.checkpoint_seconds, job.checkpoint_at = report.seconds, timezone.now()
    job.save(update_fields=["checkpoint_step", "checkpoint_path", "checkpoint_seconds", "checkpoint_at", "updated_at"])
    publish_job(job, "upsert")
    stream = job_stream(job.pk)
    publish_on_commit(stream, CheckpointEvent(seq=next_seq(stream), job=job.pk, step=report.step,
                                              path=report.checkpoint_path, seconds=report.seconds))


def _restored(job: Job, report: protocol.JobRestored) -> None:
    restore.restore_record_report(job, report)


def _failed(job: Job, report: protocol.JobFailed) -> None:
    ranks = ", ".join(map(str, report.ranks)) or "unknown"
    error = f"node {report.node or '?'} ranks {ranks}: {report.error or 'failed without a reason'}"
    if restore.restore_begin(job, cause=f"node {report.node or '?'} ranks {ranks} failed", known_lost=False,
                             lost_nodes={report.node}, detail=error):
        return
    nodes = [node for node in transitions.job_nodes(job) if node != report.node]
    job_finish(job, state=job_next_state(JobState(job.state), JobTrigger.FAIL), error=error)
    stop_on_commit(job, nodes)


HANDLERS = {"started": _started, "step": _step, "stopped": _stopped, "failed": _failed, "checkpoint": _checkpoint,
            "restored": _restored, "orphaned": restore.restore_record_orphan}


# --- transitions --------------------------------------------------------------------------

_MEASURED = ("prepare_seconds", "pause_seconds", "transfer_seconds", "verify_seconds", "network_bytes", "rounds",
             "peak_bytes", "predicted_peak_bytes")


def _fill(transition: Transition, report: protocol.TransitionReport, *, overwrite: bool) -> bool:
    """Copy the report's figures onto the transition (only into empty fields unless
    `overwrite`); True when something changed."""
    changed = False
    for name in _MEASURED:
        value = getattr(report, name)
        if value is not None and (overwrite or getattr(transition, name) is None) and getattr(transition, name) != value:
            setattr(transition, name, value)
            changed = True
    if report.step is not None and (overwrite or transition.step is None) and transition.step != report.step:
        transition.step = report.step
        changed = True
    tensors = [check.model_dump() for check in report.tensors] if report.tensors is not None else None
    if report.state == TransitionState.COMMITTED and (overwrite or not transition.verification):
        verification = {"verified": report.verified, "fingerprint": report.fingerprint,
                        "matches_plan": (report.fingerprint == transition.plan_fingerprint)
                        if report.fingerprint and transition.plan_fingerprint else None,
                        "node": report.node, "tensors": tensors}
        if report.phases:
            verification["phases"] = dict(report.phases)  # where the pause went (rank 0)
        if verification != transition.verification:
            transition.verification = verification
            changed = True
    elif report.state == TransitionState.ROLLED_BACK and tensors and not transition.verification:
        transition.verification = {"verified": False, "fingerprint": report.fingerprint, "matches_plan": None,
                                   "node": report.node, "tensors": tensors}  # the digests that did not match
        changed = True
    if report.progress is not None:
        progress = merge_progress(transition.progress or {}, report.progress)
        if progress != transition.progress:
            transition.progress = progress
            changed = True
    return changed


def transition_record_report(*, report: protocol.TransitionReport) -> Transition | None:
    """Apply one transition report; returns the transition (None when unknown)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=report.job_id).first()
        transition = (Transition.objects.select_for_update().filter(pk=report.transition_id, job_id=report.job_id)
                      .first() if job is not None else None)
        if transition is None:
            log.info("ignored %s report from %s: transition %s of job %s does not exist", report.state, report.node,
                     report.transition_id, report.job_id)
            return None
        if transition.kind == TransitionKind.RESTORE:
            _restore_report(job, transition, report)
            return transition
        state, target = TransitionState(transition.state), TransitionState(report.state)
        moved = False
        if state in TERMINAL_TRANSITION_STATES:
            log.info("ignored %s report from %s: transition %s of job %s is already %s", report.state, report.node,
                     transition.pk, job.name, state)
        elif target in (TransitionState.ABORTED, TransitionState.ROLLED_BACK):
            moved = _undo(job, transition, state, target, report)
        else:
            path = transition_forward_path(state, target)
            if not path and report.progress is None:  # (live progress repeats `transferring`)
                log.info("late or duplicate %s report from %s: transition %s of job %s is %s", report.state,
                         report.node, transition.pk, job.name, state)
            now = timezone.now()
            for step in path:
                transitions.enter(transition, step, reported=step is target, at=now)
            moved = bool(path)
        # Figures of a late report complete a live or committed transition, never an aborted one.
        filled = state not in (TransitionState.ABORTED, TransitionState.ROLLED_BACK) and _fill(
            transition, report, overwrite=moved)
        if moved and target is TransitionState.COMMITTED:
            _check_commit(job, transition)
            transitions.commit(job, transition)
        if moved or filled:
            transition.save()
            transitions.publish_transition(transition)
    return transition


def _restore_report(job: Job, transition: Transition, report: protocol.TransitionReport) -> None:
    """Rank 0 of a world switched on the survivors: `committed` with the engine's figures
    (transfer, verify, digests per tensor) commits the planned restore row."""
    if report.state != TransitionState.COMMITTED or transition.state != TransitionState.PLANNED:
        log.info("ignored %s report from %s: restore %s of job %s is %s", report.state, report.node, transition.pk,
                 job.name, transition.state)
        return
    transitions.enter(transition, restore_next_state(TransitionState.PLANNED, TransitionState.COMMITTED),
                      reported=True)
    survivors = transition.verification.get("survivors")
    _fill(transition, report, overwrite=True)
    transition.verification = {**transition.verification, "survivors": survivors}
    _check_commit(job, transition)
    transition.save()
    transitions.publish_transition(transition)


def _undo(job: Job, transition: Transition, state: TransitionState, target: TransitionState,
          report: protocol.TransitionReport) -> bool:
    """aborted / rolled_back from the ranks: the job keeps its source layout."""
    try:
        new = transition_next_state(state, target)
    except IllegalTransition:
        if target is TransitionState.ROLLED_BACK and state in (TransitionState.PLANNED, TransitionState.PREPARING,
                                                               TransitionState.READY):
            new = TransitionState.ABORTED  # nothing had moved yet: the source layout never left
        else:  # aborted after the state started moving: only a failure report can tell what is left
            log.error("ignored %s report from %s: transition %s of job %s is %s (%s)", report.state, report.node,
                      transition.pk, job.name, state, report.error or "no error given")
            return False
    transitions.enter(transition, new, reported=new is target)
    why = f"{report.state} by the ranks ({report.node or '?'}): {report.error or 'no reason given'}"
    transition.reason = f"{transition.reason}; {why}" if transition.reason else why
    transitions.undo(job, transition)
    return True


def _check_commit(job: Job, transition: Transition) -> None:
    verification = transition.verification
    if verification.get("verified") is False:
        log.error("job %s: transition %s committed without a verified state", job.name, transition.pk)
    if verification.get("matches_plan") is False:
        log.error("job %s: transition %s ran plan %s, the control plane planned %s", job.name, transition.pk,
                  verification.get("fingerprint"), transition.plan_fingerprint)
