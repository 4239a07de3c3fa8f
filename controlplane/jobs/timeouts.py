"""The control plane's timeout for a stuck resize (docs/elastic.md, "Stuck transitions").

A resize moves only on reports from rank 0. The ranks time out on their own (rank 0
abandons a switch whose joining ranks are not ready within the job's timeout, a transfer
whose peer vanished rolls back), but when rank 0 or its agent never answers at all, no
report comes and the job would stay `switching`. The beat task
`control.sweep_stuck_transitions` calls transitions_time_out every few seconds: a resize
that has not moved (its latest history entry) for DYNAPLANE_TRANSITION_TIMEOUT_SECONDS ends
by the rule of timeout_outcome:
- planned or preparing: nothing has moved, the old ranks still train their layout: the
  resize is aborted, the joining ranks' GPUs are freed and the job's nodes get a
  JobSwitchCancel (the agents stop the joining ranks and tell rank 0 to drop the switch);
- ready, transferring or verifying: the old ranks may have left their layout, and what
  they still hold is unknown: the job restarts from its latest checkpoint (restore.py), or,
  without one, fails with the reason.
"""
from __future__ import annotations

import logging
from datetime import datetime, timedelta
from enum import StrEnum

from django.db import transaction
from django.utils import timezone

from agents import protocol
from controlplane.jobs import transitions
from controlplane.jobs.failures import job_fail
from controlplane.jobs.lifecycle import TERMINAL_TRANSITION_STATES, TransitionKind, TransitionState
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.orders import send_cancels_on_commit
from controlplane.jobs.restore import no_restore_reason, restore_begin

log = logging.getLogger(__name__)


class TimeoutOutcome(StrEnum):
    ABORT = "abort"  # the job trains on in its old layout
    RECOVER = "recover"  # restore from the checkpoint, else fail


def timeout_outcome(state: TransitionState) -> TimeoutOutcome:
    """What a resize stuck in `state` ends with (pure; ValueError for a terminal state)."""
    if state in TERMINAL_TRANSITION_STATES:
        raise ValueError(f"a {state.value} transition cannot time out")
    if state in (TransitionState.PLANNED, TransitionState.PREPARING):
        return TimeoutOutcome.ABORT
    return TimeoutOutcome.RECOVER


def last_moved(transition: Transition) -> datetime:
    """When the transition last changed state (or was created)."""
    if transition.history:
        return datetime.fromisoformat(transition.history[-1]["at"])
    return transition.created_at


def transitions_time_out(*, timeout: timedelta, now: datetime | None = None) -> list[int]:
    """End every active resize that has not moved for `timeout`; returns their ids."""
    now = now or timezone.now()
    ended = []
    active = Transition.objects.filter(kind=TransitionKind.RESIZE).exclude(
        state__in=[s.value for s in TERMINAL_TRANSITION_STATES]).values_list("pk", flat=True)
    for transition_id in list(active):
        if _time_out(transition_id, timeout, now):
            ended.append(transition_id)
    return ended


def _time_out(transition_id: int, timeout: timedelta, now: datetime) -> bool:
    with transaction.atomic():
        job_id = Transition.objects.filter(pk=transition_id).values_list("job_id", flat=True).first()
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        row = Transition.objects.select_for_update().filter(pk=transition_id).first()
        if job is None or row is None or row.state in TERMINAL_TRANSITION_STATES or now - last_moved(row) < timeout:
            return False  # a report moved it, or the job ended it, since the sweep looked
        state = TransitionState(row.state)
        stuck = (f"no report from the ranks for {timeout.total_seconds():.0f} s while the resize was {state.value} "
                 f"(DYNAPLANE_TRANSITION_TIMEOUT_SECONDS)")
        if timeout_outcome(state) is TimeoutOutcome.ABORT:
            nodes = transitions.job_nodes(job)  # the joining ranks' nodes included
            why = f"{stuck}: aborted by the control plane; the job trains on in {job.layout}"
            transitions.abort(job, row, why, at=now)
            send_cancels_on_commit(job, nodes, protocol.JobSwitchCancel(job_id=job.pk, transition_id=row.pk,
                                                                         reason=why[:2000]))
            log.warning("job %s: transition %s %s", job.name, row.pk, why)
            return True
        if not restore_begin(job, cause=f"transition {row.pk} stuck: {stuck}", known_lost=True):
            job_fail(job_id=job.pk, error=f"transition {row.pk} stuck: {stuck}; "
                                          f"{no_restore_reason(job) or f'the job was {job.state}'}")
    return True
