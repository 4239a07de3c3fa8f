"""Liveness that knows when the control plane could not hear (issue 43 item 3): a node silent
during a broker outage is not lost for it; one that stays silent once sweeps arrive again is,
after the configured time."""
from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.cluster.shared_hearing import SharedHearing
from controlplane.cluster.models import Node
from controlplane.jobs import node_loss
from controlplane.jobs.tasks import HEARING, sweep_lost_nodes
from tests.controlplane.conftest import heartbeat
from controlplane.cluster import services as cluster

SILENT = timedelta(seconds=6)


def test_arrivals_at_any_process_extend_one_run_and_a_gap_in_all_of_them_starts_a_new_one() -> None:
    """Two worker processes (two SharedHearing on one Redis) taking the sweeps in turn: one run,
    never broken by the other's arrivals; a pause longer than the gap, or an interrupt (a sweep
    that could not look), starts a new run for both."""
    import time

    gap = timedelta(seconds=0.4)
    first, second = SharedHearing(gap), SharedHearing(gap)
    first.forget()
    began = timezone.now()
    assert abs((first.sweep_arrived(began) - began).total_seconds()) < 0.05  # a fresh run
    for n in range(8):  # 1.2 s of sweeps 0.15 s apart, taken by each in turn
        time.sleep(0.15)
        hearing = (first, second)[n % 2]
        since = hearing.sweep_arrived(now := timezone.now())
        assert abs((since - began).total_seconds()) < 0.1, (n, now - since)
    time.sleep(0.6)  # a gap in every process's arrivals (the broker was away)
    back = timezone.now()
    assert abs((second.sweep_arrived(back) - back).total_seconds()) < 0.05
    time.sleep(0.15)
    assert abs((first.sweep_arrived(timezone.now()) - back).total_seconds()) < 0.1
    second.interrupt()  # the database was down for that sweep
    again = timezone.now()
    assert abs((first.sweep_arrived(again) - again).total_seconds()) < 0.05


@pytest.mark.django_db
def test_nodes_silent_through_an_outage_are_kept_until_the_sweeps_have_heard_for_the_silence_time(run) -> None:
    cluster.node_record_heartbeat(report=heartbeat("node-1"), received_at=timezone.now())
    cluster.node_record_heartbeat(report=heartbeat("node-2"), received_at=timezone.now())
    back = timezone.now() + timedelta(seconds=60)  # the broker answers again after a minute
    # node-1 beats again right away; node-2 never does (it died during the outage)
    cluster.node_record_heartbeat(report=heartbeat("node-1"), received_at=back + timedelta(seconds=1))
    assert run(node_loss.nodes_lost_sweep, silent_for=SILENT, now=back + timedelta(seconds=2), heard_since=back) == []
    assert set(Node.objects.values_list("state", flat=True)) == {"healthy"}
    later = back + timedelta(seconds=7)
    cluster.node_record_heartbeat(report=heartbeat("node-1"), received_at=later)
    assert run(node_loss.nodes_lost_sweep, silent_for=SILENT, now=later, heard_since=back) == ["node-2"]


@pytest.mark.django_db
def test_the_beat_task_keeps_its_run_of_hearing(run, monkeypatch) -> None:
    """The task passes its own arrivals: a first sweep (a worker just started, or back from an
    outage) marks nothing lost however old the heartbeats."""
    HEARING.forget()
    cluster.node_record_heartbeat(report=heartbeat("node-1"), received_at=timezone.now() - timedelta(minutes=5))
    assert run(sweep_lost_nodes) == []
    assert Node.objects.get(name="node-1").state == "healthy"


@pytest.mark.django_db
def test_sweeps_that_fail_on_the_database_never_count_as_hearing(run, monkeypatch) -> None:
    """A database outage: every sweep fails (here at its last step, as the elastic nudge did in
    CI while the lost-node look was skipped as too early). When the database answers again,
    silences from the outage count for nothing: the first good sweep starts a new run."""
    from django.db import OperationalError

    from controlplane.jobs import elastic_trigger

    HEARING.forget()
    cluster.node_record_heartbeat(report=heartbeat("node-1"), received_at=timezone.now() - timedelta(seconds=30))
    database = {"up": False}
    nudge = elastic_trigger.nudge_for_joined_nodes

    def nudge_or_fail() -> None:
        if not database["up"]:
            raise OperationalError("connection refused")
        nudge()

    monkeypatch.setattr(elastic_trigger, "nudge_for_joined_nodes", nudge_or_fail)
    from controlplane.jobs import tasks

    monkeypatch.setattr(tasks, "timezone", _Clock(timezone.now()))
    for _ in range(8):  # 8 s of failing sweeps, a second apart: more than the 6 s of silence
        with pytest.raises(OperationalError):
            run(sweep_lost_nodes)
    database["up"] = True
    assert run(sweep_lost_nodes) == []
    assert Node.objects.get(name="node-1").state == "healthy"


class _Clock:
    """django.utils.timezone for the task: each sweep a second after the one before."""

    def __init__(self, start) -> None:
        self.at = start

    def now(self):
        self.at += timedelta(seconds=1)
        return self.at
