"""A job's transitions (layout switches) in the database: state changes, what a commit or
an abort does to the job and its GPUs, and the live `transition` events.

Called with the job's row locked (and the transition's): by the resize service
(resize.py), the transition report task (reports.py) and the job-failure path
(scheduling.job_finish). Nothing here sends orders to the agents.
"""
from __future__ import annotations

import logging

from django.db.models import Q
from django.utils import timezone

from controlplane.cluster.models import Gpu
from controlplane.cluster.services import gpus_release
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.jobs.events import TransitionEvent, job_stream
from controlplane.jobs.lifecycle import (
    TERMINAL_TRANSITION_STATES,
    JobState,
    JobTrigger,
    TransitionState,
    job_next_state,
    transition_end_with_job,
)
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.selectors import transition_view
from controlplane.jobs.services import publish_job

log = logging.getLogger(__name__)


def publish_transition(transition: Transition) -> None:
    """The transition's new state, on commit, to the job's stream (/ws/jobs/<id>/)."""
    stream = job_stream(transition.job_id)
    publish_on_commit(stream, TransitionEvent(seq=next_seq(stream), transition=transition_view(transition)))


def active_transition(job: Job, *, lock: bool = False) -> Transition | None:
    """The job's transition that is not terminal yet (at most one: a partial unique index)."""
    queryset = Transition.objects.filter(job=job).exclude(state__in=[s.value for s in TERMINAL_TRANSITION_STATES])
    return (queryset.select_for_update() if lock else queryset).first()


def job_nodes(job: Job) -> list[str]:
    """Nodes with ranks of the job: its placement's, and during a transition also the nodes
    of the joining ranks (they run processes, or are starting them)."""
    return nodes_of(job, active_transition(job))


def nodes_of(job: Job, active: Transition | None) -> list[str]:
    """job_nodes() with the job's active transition already read (`active`)."""
    nodes = list(job.nodes)
    if active is not None:
        nodes += [slot["node"] for slot in active.destination_placement]
    return list(dict.fromkeys(nodes))


def enter(transition: Transition, state: TransitionState, *, reported: bool, at=None) -> None:
    """Record entering `state` (the caller checked the lifecycle): history, started_at
    (leaving planned), finished_at (a terminal state)."""
    at = at or timezone.now()
    transition.state = state.value
    transition.history = [*transition.history, {"state": state.value, "at": at.isoformat(), "reported": reported}]
    if state is not TransitionState.PLANNED and transition.started_at is None:
        transition.started_at = at
    if state in TERMINAL_TRANSITION_STATES:
        transition.finished_at = at


def _gpus(slots: list[dict]) -> set[tuple[str, int]]:
    return {(slot["node"], slot["gpu"]) for slot in slots}


def leaving_slots(transition: Transition) -> list[dict]:
    """Source slots whose GPU the destination does not use (their processes leave)."""
    kept = _gpus(transition.destination_placement)
    return [slot for slot in transition.source_placement if (slot["node"], slot["gpu"]) not in kept]


def joining_slots(transition: Transition) -> list[dict]:
    """Destination slots on GPUs the source did not use (new processes run them)."""
    old = _gpus(transition.source_placement)
    return [slot for slot in transition.destination_placement if (slot["node"], slot["gpu"]) not in old]


def _release_slots(job: Job, slots: list[dict]) -> None:
    """Free the GPUs of these rank slots that the job still holds (lost ones stay lost)."""
    if not slots:
        return
    where = Q()
    for slot in slots:
        where |= Q(node__name=slot["node"], index=slot["gpu"])
    gpus_release(gpus=Gpu.objects.filter(where, job=job))


def _back_to_running(job: Job) -> None:
    if job.state == JobState.SWITCHING:
        job.state = job_next_state(JobState.SWITCHING, JobTrigger.SWITCHED)


def commit(job: Job, transition: Transition) -> None:
    """A committed transition: the job trains the destination layout on the destination
    placement, the leaving ranks' GPUs are free, switching -> running. The job keeps its
    start rendezvous (and port): rank 0's process still holds that store open, as it holds
    every union store it served (see scheduling._free_port)."""
    leaving = leaving_slots(transition)
    job.layout = transition.destination_layout
    job.world_size = transition.destination_world
    job.placement = transition.destination_placement
    job.resize_failures = 0  # (the elastic scheduler's backoff starts again)
    _back_to_running(job)
    job.save(update_fields=["layout", "world_size", "placement", "state", "resize_failures", "updated_at"])
    _release_slots(job, leaving)
    publish_job(job, "upsert")


def undo(job: Job, transition: Transition) -> None:
    """An aborted or rolled-back transition while the job lives on: it keeps (or is back on)
    its source layout and placement, which were never overwritten; the joining ranks' GPUs
    are free; switching -> running. It counts as a failed resize: the elastic scheduler
    backs off the job for a while, longer after each failure in a row."""
    _release_slots(job, joining_slots(transition))
    job.resize_failures += 1
    job.resize_failed_at = transition.finished_at or timezone.now()
    switching = job.state == JobState.SWITCHING
    _back_to_running(job)
    job.save(update_fields=["state", "resize_failures", "resize_failed_at", "updated_at"])
    if switching:
        publish_job(job, "upsert")


def abort(job: Job, transition: Transition, why: str, *, at=None) -> None:
    """End a resize the ranks never carried out as `aborted`, `why` added to its reason; the job
    trains on in its layout (undo). The caller tells the nodes that had the order to drop it."""
    enter(transition, TransitionState.ABORTED, reported=False, at=at)
    transition.reason = f"{transition.reason}; {why}" if transition.reason else why
    transition.save()
    undo(job, transition)
    publish_transition(transition)


def end_with_restore(job: Job, why: str) -> Transition | None:
    """The job (locked) lost ranks and restarts from a checkpoint: its active transition (a
    resize, or a restore whose new world failed too) ends aborted with `why`. Its GPUs stay
    the job's: the restore picks the survivors among them, joining ranks' ones included."""
    transition = active_transition(job, lock=True)
    if transition is None:
        return None
    was = transition.state
    enter(transition, transition_end_with_job(TransitionState(was)), reported=False)
    why = f"ranks lost while the {transition.kind} was {was}: {why}"
    transition.reason = f"{transition.reason}; {why}" if transition.reason else why
    transition.save()
    publish_transition(transition)
    log.warning("job %s: transition %s aborted (%s)", job.name, transition.pk, why)
    return transition


def end_with_job(job: Job, *, state: JobState, error: str = "") -> Transition | None:
    """The job (locked) is about to stop or fail: its active transition, if any, ends
    aborted with the reason (the job's GPUs, joining ones included, are then released by
    the caller). The agents cannot restore the old layout, so this is never rolled_back."""
    transition = active_transition(job, lock=True)
    if transition is None:
        return None
    was = transition.state
    enter(transition, transition_end_with_job(TransitionState(was)), reported=False)
    why = f"the job {state.value} while the transition was {was}" + (f": {error}" if error else "")
    transition.reason = f"{transition.reason}; {why}" if transition.reason else why
    transition.save()
    publish_transition(transition)
    log.warning("job %s: transition %s aborted (%s)", job.name, transition.pk, why)
    return transition
