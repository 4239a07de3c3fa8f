"""Lifecycles: pure transition functions, explored by hypothesis."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from controlplane.cluster.lifecycle import GpuState, GpuTrigger, IllegalTransition, gpu_next_state
from controlplane.jobs.lifecycle import (
    DELETABLE_JOB_STATES, TERMINAL_TRANSITION_STATES, JobState, JobTrigger, TransitionState, job_next_state,
    transition_next_state,
)


class GpuMachine(RuleBasedStateMachine):
    """A GPU under random triggers: it is lost exactly while its node is lost, and a job
    keeps its GPU across a node outage."""

    def __init__(self) -> None:
        super().__init__()
        self.state = GpuState.FREE
        self.node_lost = False
        self.held = False

    def _fire(self, trigger: GpuTrigger) -> None:
        try:
            self.state = gpu_next_state(self.state, trigger, held_by_job=self.held)
        except IllegalTransition:
            return
        if trigger is GpuTrigger.ALLOCATE:
            self.held = True
        if trigger is GpuTrigger.RELEASE:
            self.held = False

    @precondition(lambda self: not self.node_lost)
    @rule(trigger=st.sampled_from([GpuTrigger.ALLOCATE, GpuTrigger.DRAIN, GpuTrigger.RELEASE]))
    def job_action(self, trigger: GpuTrigger) -> None:
        self._fire(trigger)

    @rule()
    def node_lost(self) -> None:
        self.node_lost = True
        self._fire(GpuTrigger.NODE_LOST)

    @rule()
    def node_back(self) -> None:
        self.node_lost = False
        self._fire(GpuTrigger.NODE_BACK)

    @invariant()
    def lost_iff_node_lost(self) -> None:
        assert (self.state is GpuState.LOST) == self.node_lost

    @invariant()
    def allocation_matches_holder(self) -> None:
        if self.state is GpuState.ALLOCATED:
            assert self.held
        if self.state is GpuState.FREE:
            assert not self.held


TestGpuLifecycle = GpuMachine.TestCase


def test_illegal_gpu_transitions_name_the_state() -> None:
    with pytest.raises(IllegalTransition, match="GPU in state allocated cannot allocate"):
        gpu_next_state(GpuState.ALLOCATED, GpuTrigger.ALLOCATE)
    with pytest.raises(IllegalTransition, match="lost cannot allocate"):
        gpu_next_state(GpuState.LOST, GpuTrigger.ALLOCATE)


@given(st.lists(st.sampled_from(list(JobTrigger)), max_size=30))
def test_job_lifecycle_paths(triggers: list[JobTrigger]) -> None:
    state = JobState.PENDING
    ever_started = False
    for trigger in triggers:
        try:
            new = job_next_state(state, trigger)
        except IllegalTransition as exc:
            assert state.value in str(exc) and trigger.value in str(exc)
            continue
        if new is JobState.RUNNING:
            assert state in (JobState.STARTING, JobState.SWITCHING)
            ever_started = True
        if new is JobState.SWITCHING:
            assert ever_started
        assert state not in (JobState.STOPPED, JobState.FAILED) or new is state
        state = new


def test_only_idle_jobs_are_deletable() -> None:
    assert DELETABLE_JOB_STATES == {JobState.PENDING, JobState.STOPPED, JobState.FAILED}


@given(st.lists(st.sampled_from(list(TransitionState)), max_size=12))
def test_transition_lifecycle(targets: list[TransitionState]) -> None:
    state = TransitionState.PLANNED
    history = [state]
    for target in targets:
        try:
            state = transition_next_state(state, target)
        except IllegalTransition:
            continue
        history.append(state)
    if state is TransitionState.COMMITTED:
        assert history == [
            TransitionState.PLANNED, TransitionState.PREPARING, TransitionState.READY,
            TransitionState.TRANSFERRING, TransitionState.VERIFYING, TransitionState.COMMITTED,
        ]
    if state is TransitionState.ROLLED_BACK:
        assert TransitionState.TRANSFERRING in history
    if state is TransitionState.ABORTED:
        assert TransitionState.TRANSFERRING not in history
    for terminal in TERMINAL_TRANSITION_STATES:
        assert history.count(terminal) <= 1
