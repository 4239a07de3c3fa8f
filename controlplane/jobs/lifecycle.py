"""Job and transition lifecycles: documented enums, pure transition functions.

Job:        pending -> starting -> running <-> switching ; starting -> pending (its pre-flight
            failed or was cancelled: no rank was ordered to start, preflight.py) ; running/starting/switching ->
            stopping -> stopped ; any live state -> failed ;
            running/starting/switching -> restoring (ranks lost; a checkpoint exists, or the
            survivors may take over) -> starting (a new world loads the checkpoint, or the
            survivors switch onto a new layout) ; restoring -> stopped (stop).
Transition: planned -> preparing -> ready -> transferring -> verifying -> committed;
            planned/preparing/ready -> aborted (old layout never left);
            transferring/verifying -> rolled_back (old layout restored).
            A job that fails or stops during a transition ends it aborted from any
            active state (transition_end_with_job): the agents cannot restore the old
            layout yet, so rolled_back would be untrue; the reason says where it stopped.
"""
from __future__ import annotations

from enum import StrEnum

from controlplane.cluster.lifecycle import IllegalTransition


class JobState(StrEnum):
    PENDING = "pending"
    STARTING = "starting"
    RUNNING = "running"
    SWITCHING = "switching"
    RESTORING = "restoring"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


class JobTrigger(StrEnum):
    START = "start"
    STARTED = "started"
    SWITCH = "switch"
    SWITCHED = "switched"
    STOP = "stop"
    STOPPED = "stopped"
    FAIL = "fail"
    RESTORE = "restore"
    RESTART = "restart"
    UNSTART = "unstart"


_JOB_EDGES: dict[tuple[JobState, JobTrigger], JobState] = {
    (JobState.PENDING, JobTrigger.START): JobState.STARTING,
    (JobState.STARTING, JobTrigger.STARTED): JobState.RUNNING,
    (JobState.STARTING, JobTrigger.UNSTART): JobState.PENDING,
    (JobState.RUNNING, JobTrigger.SWITCH): JobState.SWITCHING,
    (JobState.SWITCHING, JobTrigger.SWITCHED): JobState.RUNNING,
    (JobState.PENDING, JobTrigger.STOP): JobState.STOPPED,
    (JobState.STARTING, JobTrigger.STOP): JobState.STOPPING,
    (JobState.RUNNING, JobTrigger.STOP): JobState.STOPPING,
    (JobState.SWITCHING, JobTrigger.STOP): JobState.STOPPING,
    (JobState.STOPPING, JobTrigger.STOPPED): JobState.STOPPED,
    (JobState.STARTING, JobTrigger.RESTORE): JobState.RESTORING,
    (JobState.RUNNING, JobTrigger.RESTORE): JobState.RESTORING,
    (JobState.SWITCHING, JobTrigger.RESTORE): JobState.RESTORING,
    (JobState.RESTORING, JobTrigger.RESTART): JobState.STARTING,
    (JobState.RESTORING, JobTrigger.STOP): JobState.STOPPED,  # no rank trains: nothing to wait for
}
_LIVE = {JobState.STARTING, JobState.RUNNING, JobState.SWITCHING, JobState.RESTORING, JobState.STOPPING}
# Live: ranks may be running on nodes (GPUs held, rendezvous port in use).
LIVE_JOB_STATES = frozenset(_LIVE)
DELETABLE_JOB_STATES = frozenset({JobState.PENDING, JobState.STOPPED, JobState.FAILED})
# What each action on a job accepts (scheduling.job_start and job_stop, resize.job_resize,
# services.job_delete); the job page enables its buttons and resize controls from these.
STARTABLE_JOB_STATES = frozenset({JobState.PENDING})
STOPPABLE_JOB_STATES = frozenset(_LIVE | {JobState.PENDING})
RESIZABLE_JOB_STATES = frozenset({JobState.RUNNING})


def job_next_state(state: JobState, trigger: JobTrigger) -> JobState:
    if trigger is JobTrigger.FAIL and state in _LIVE | {JobState.PENDING}:
        return JobState.FAILED
    try:
        return _JOB_EDGES[(state, trigger)]
    except KeyError:
        raise IllegalTransition(f"job in state {state.value} cannot {trigger.value}") from None


class TransitionState(StrEnum):
    PLANNED = "planned"
    PREPARING = "preparing"
    READY = "ready"
    TRANSFERRING = "transferring"
    VERIFYING = "verifying"
    COMMITTED = "committed"
    ABORTED = "aborted"
    ROLLED_BACK = "rolled_back"


_FORWARD = [
    TransitionState.PLANNED, TransitionState.PREPARING, TransitionState.READY,
    TransitionState.TRANSFERRING, TransitionState.VERIFYING, TransitionState.COMMITTED,
]
TERMINAL_TRANSITION_STATES = frozenset({TransitionState.COMMITTED, TransitionState.ABORTED, TransitionState.ROLLED_BACK})


def transition_next_state(state: TransitionState, target: TransitionState) -> TransitionState:
    """Move a transition to `target` if the lifecycle allows it."""
    if state in TERMINAL_TRANSITION_STATES:
        raise IllegalTransition(f"transition already {state.value}")
    if state in _FORWARD and target in _FORWARD and _FORWARD.index(target) == _FORWARD.index(state) + 1:
        return target
    if target is TransitionState.ABORTED and state in (TransitionState.PLANNED, TransitionState.PREPARING, TransitionState.READY):
        return target
    if target is TransitionState.ROLLED_BACK and state in (TransitionState.TRANSFERRING, TransitionState.VERIFYING):
        return target
    raise IllegalTransition(f"transition in state {state.value} cannot become {target.value}")


class TransitionKind(StrEnum):
    """resize: an online layout switch (the lifecycle above). restore: after ranks were lost,
    a restart of the job from a checkpoint or a switch on the surviving ranks' memory;
    planned (new world ordered) -> committed (it loaded the checkpoint / switched its state,
    verified) or aborted (it failed too, or the job stopped)."""

    RESIZE = "resize"
    RESTORE = "restore"


def restore_next_state(state: TransitionState, target: TransitionState) -> TransitionState:
    if state is TransitionState.PLANNED and target in (TransitionState.COMMITTED, TransitionState.ABORTED):
        return target
    raise IllegalTransition(f"restore in state {state.value} cannot become {target.value}")


def transition_forward_path(state: TransitionState, target: TransitionState) -> list[TransitionState]:
    """The forward states from `state` (exclusive) to `target` (inclusive), e.g. transferring
    -> committed passes verifying. Empty when `target` is not ahead of `state` on the forward
    path (a late or duplicate report). Each step is checked by transition_next_state."""
    if state not in _FORWARD or target not in _FORWARD:
        return []
    path = _FORWARD[_FORWARD.index(state) + 1:_FORWARD.index(target) + 1]
    at = state
    for step in path:
        at = transition_next_state(at, step)
    return path


def transition_end_with_job(state: TransitionState) -> TransitionState:
    """An active transition whose job failed or stopped: aborted, whatever state it reached."""
    if state in TERMINAL_TRANSITION_STATES:
        raise IllegalTransition(f"transition already {state.value}")
    return TransitionState.ABORTED
