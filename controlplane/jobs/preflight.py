"""Pre-flight before a start or a grow across hosts (issue 44, docs/hosts.md "Pre-flight").

A start whose ranks span more than one host (nodes with different advertised addresses), or a
resize whose joining ranks make the union world span more than one, does not send its start or
switch orders at once: every node involved first gets a PreflightOrder and checks, with the
others, what its ranks will need (agents/node/preflight.py: storage, data, the rendezvous port,
the rendezvous, a gloo all-reduce, shared storage). When every node has passed, the orders go
out. When a check fails, or a node does not answer within the deadline, the job stays as it
was: a start goes back to pending with its GPUs and port freed and the failure, by host and
check, in its error; a grow is aborted with it and the job trains on in its layout.

DYNAPLANE_PREFLIGHT: "hosts" (the default: only what spans hosts), "always" (every start and
grow, one host too) or "off".
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from agents import protocol
from controlplane.cluster.models import Gpu, Node
from controlplane.cluster.services import gpus_release
from controlplane.jobs import transitions
from controlplane.jobs.failures import send_starts_on_commit
from controlplane.jobs.lifecycle import (JobState, JobTrigger, TransitionKind, TransitionState, job_next_state,
                                        restore_next_state)
from controlplane.jobs.models import Job, Preflight, Transition
from controlplane.jobs.orders import dataset_directory, initial_weights_directory, send, start_orders
from controlplane.jobs.services import publish_job
from controlplane.jobs.switch_orders import send_switches, switch_orders

log = logging.getLogger(__name__)

MODES = ("hosts", "always", "off")


def deadline_seconds() -> float:
    """How long the control plane waits for every node's report: the nodes' own wait, twice
    (an agent may get its order late, and load torch first), and 10 s for the broker."""
    return 2 * settings.DYNAPLANE_PREFLIGHT_SECONDS + 10


def preflight_needed(nodes: list[str]) -> bool:
    mode = settings.DYNAPLANE_PREFLIGHT
    if mode == "off" or not nodes:
        return False
    if mode == "always":
        return True
    return len(set(Node.objects.filter(name__in=nodes).values_list("host", flat=True))) > 1


@dataclass(frozen=True, slots=True)
class Verdict:
    passed: bool | None  # None: a node has not reported yet
    error: str = ""


def _label(entry: dict) -> str:
    host = entry.get("host") or ""
    return f"host {entry['node']}" + (f" ({host})" if host and host != entry["node"] else "")


def preflight_verdict(nodes: list[dict], results: dict, *, timed_out: bool = False) -> Verdict:
    """Pass when every node reported every check passed; fail naming each host's first failed
    check (and, once `timed_out`, each host that never reported); None while reports are due.
    Pure: `nodes` [{node, host}] in order, `results` node -> {checks: [{name, ok, detail}]}."""
    failures, waiting = [], False
    for entry in nodes:
        result = results.get(entry["node"])
        if result is None:
            if timed_out:
                failures.append(f"{_label(entry)}: no report within {deadline_seconds():.0f} s (its agent is down, "
                                f"busy, or cannot reach the broker)")
            waiting = True
            continue
        bad = [check for check in result.get("checks", []) if not check.get("ok")]
        if bad:
            failures.append(f"{_label(entry)}: {bad[0]['name']}: {bad[0]['detail']}")
    if waiting and not timed_out:
        return Verdict(None)
    if failures:
        return Verdict(False, "pre-flight failed: " + "; ".join(failures))
    return Verdict(True)


def _begin(job: Job, *, nodes: list[str], rendezvous: str, read_dirs: list[str],
           transition: Transition | None = None) -> Preflight:
    hosts = dict(Node.objects.filter(name__in=nodes).values_list("name", "host"))
    row = Preflight.objects.create(job=job, transition=transition, rendezvous=rendezvous,
                                   nodes=[{"node": node, "host": hosts.get(node, "")} for node in nodes])
    order = protocol.PreflightOrder(
        preflight_id=row.pk, job_id=job.pk, job_name=job.name, nodes=tuple(nodes), rendezvous=rendezvous,
        checkpoint_dir=job.checkpoint_dir, read_dirs=tuple(dict.fromkeys(d for d in read_dirs if d)),
        timeout_seconds=settings.DYNAPLANE_PREFLIGHT_SECONDS)
    transaction.on_commit(lambda: _send_orders(order))
    log.info("job %s: pre-flight %s on %s before its %s", job.name, row.pk, ", ".join(nodes),
             "start" if transition is None else f"switch to {transition.destination_layout}")
    return row


def _send_orders(order: protocol.PreflightOrder) -> None:
    for node in order.nodes:
        try:
            send(protocol.NODE_PREFLIGHT, node, order)
        except (OperationalError, OSError) as exc:
            log.error("job %s: pre-flight order to node %s not sent: %s", order.job_id, node, exc)
            preflight_end(order.preflight_id, Verdict(False, f"pre-flight failed: the order to node {node} could "
                                                             f"not be sent ({exc})"))
            return


def start_when_checked(job: Job) -> Preflight | None:
    """A start's orders after commit, or first its pre-flight when the job spans hosts (the job,
    locked, is starting with its placement and rendezvous set)."""
    if not preflight_needed(job.nodes):
        send_starts_on_commit(job, start_orders(job))
        return None
    reads = [dataset_directory(job), initial_weights_directory(job), job.checkpoint_path if job.restore_id else ""]
    return _begin(job, nodes=job.nodes, rendezvous=job.rendezvous, read_dirs=reads)


def _grow_nodes(orders: dict[str, protocol.JobSwitchOrder], transition: Transition) -> list[str] | None:
    """The union world's nodes, rank 0's first, when the switch has joining ranks; else None."""
    joining = any(slot.rank >= transition.source_world for order in orders.values() for slot in order.ranks)
    return list(orders) if joining else None


def switch_when_checked(job: Job, transition: Transition) -> Preflight | None:
    """A resize's switch orders after commit, or first its pre-flight when joining ranks make the
    union world span hosts (switch_orders lists the nodes from process 0's, rank 0's, on)."""
    orders = switch_orders(job, transition)
    nodes = _grow_nodes(orders, transition)
    if nodes is None or not preflight_needed(nodes):
        transaction.on_commit(lambda: send_switches(job.pk, orders))
        return None
    return _begin(job, nodes=nodes, rendezvous=transition.rendezvous, read_dirs=[dataset_directory(job)],
                  transition=transition)


def preflight_record(report: protocol.PreflightReport) -> None:
    """One node's report; the pre-flight ends once every node has reported."""
    with transaction.atomic():
        row = Preflight.objects.select_for_update().filter(pk=report.preflight_id, job_id=report.job_id).first()
        if row is None or row.state != Preflight.State.RUNNING:
            log.info("pre-flight %s: a late report from %s", report.preflight_id, report.node)
            return
        if report.node not in {entry["node"] for entry in row.nodes}:
            log.warning("pre-flight %s: a report from %s, not one of its nodes", row.pk, report.node)
            return
        row.results = {**row.results, report.node: {"checks": [c.model_dump() for c in report.checks],
                                                    "seconds": report.seconds}}
        row.save(update_fields=["results"])
        verdict = preflight_verdict(row.nodes, row.results)
        if verdict.passed is not None:
            preflight_end(row.pk, verdict)


def preflights_time_out(*, now: datetime | None = None) -> list[int]:
    """Beat: fail the pre-flights a node has not answered within deadline_seconds()."""
    now = now or timezone.now()
    late = Preflight.objects.filter(state=Preflight.State.RUNNING,
                                    created_at__lt=now - timedelta(seconds=deadline_seconds()))
    ended = []
    for row in late:
        if preflight_end(row.pk, preflight_verdict(row.nodes, row.results, timed_out=True)):
            ended.append(row.pk)
    return ended


def preflight_end(preflight_id: int, verdict: Verdict) -> bool:
    """Carry out a verdict: the orders go out, or the job stays as it was. False when the
    pre-flight had already ended. The job is locked before the pre-flight (as everywhere)."""
    with transaction.atomic():
        job_id = Preflight.objects.filter(pk=preflight_id).values_list("job_id", flat=True).first()
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        row = Preflight.objects.select_for_update().filter(pk=preflight_id).first()
        if job is None or row is None or row.state != Preflight.State.RUNNING:
            return False
        row.finished_at = timezone.now()
        if not _still_waiting(job, row):
            row.state = Preflight.State.CANCELLED
            row.save(update_fields=["state", "finished_at"])
            return True
        row.state = Preflight.State.PASSED if verdict.passed else Preflight.State.FAILED
        row.error = verdict.error
        row.save(update_fields=["state", "error", "finished_at"])
        if row.transition_id is None:
            if verdict.passed:
                job.save(update_fields=["updated_at"])  # (reconcile's grace for the ranks to show starts now)
                send_starts_on_commit(job, start_orders(job))
            else:
                _unstart(job, verdict.error)
        else:
            transition = Transition.objects.select_for_update().get(pk=row.transition_id)
            if verdict.passed:
                orders = switch_orders(job, transition)
                transaction.on_commit(lambda: send_switches(job.pk, orders))
            else:
                transitions.abort(job, transition, f"{verdict.error}; the job trains on in {job.layout}")
        log.log(logging.INFO if verdict.passed else logging.WARNING, "job %s: pre-flight %s %s", job.name, row.pk,
                verdict.error or "passed")
    return True


def _still_waiting(job: Job, row: Preflight) -> bool:
    """Whether the start or switch the pre-flight stands before still waits for it (a stop, a
    lost node or a timeout may have ended it meanwhile)."""
    if row.transition_id is None:
        return job.state == JobState.STARTING and not Preflight.objects.filter(
            job=job, created_at__gt=row.created_at).exists()
    active = transitions.active_transition(job)
    return active is not None and active.pk == row.transition_id and active.state == TransitionState.PLANNED


def running_start_check(job: Job) -> Preflight | None:
    """The pre-flight a starting job waits for (its ranks were not ordered to start yet)."""
    if job.state != JobState.STARTING:
        return None
    row = Preflight.objects.filter(job=job, transition__isnull=True).order_by("-created_at", "-id").first()
    return row if row is not None and row.state == Preflight.State.RUNNING else None


def start_cancel(job: Job, why: str, *, failed: bool = True) -> bool:
    """A locked starting job whose pre-flight still runs: the pre-flight cancelled, the job
    back to pending (`why` its error; `failed`: counts for the elastic scheduler's backoff).
    False when the job is past its pre-flight (its ranks were ordered to start)."""
    row = running_start_check(job)
    if row is None:
        return False
    Preflight.objects.filter(pk=row.pk).update(state=Preflight.State.CANCELLED, finished_at=timezone.now(),
                                               error=why)
    _unstart(job, why, failed=failed)
    return True


def _unstart(job: Job, why: str, *, failed: bool = True) -> None:
    """starting -> pending, as before the start: GPUs and port freed, placement cleared, a
    resume's restore row aborted (the job resumes from its checkpoint when started again)."""
    gpus_release(gpus=Gpu.objects.filter(job=job))
    if job.restore_id is not None:
        row = Transition.objects.filter(pk=job.restore_id, kind=TransitionKind.RESTORE).first()
        if row is not None and row.state == TransitionState.PLANNED:
            transitions.enter(row, restore_next_state(TransitionState.PLANNED, TransitionState.ABORTED),
                              reported=False)
            row.reason = f"{row.reason}; {why}"
            row.save()
            transitions.publish_transition(row)
        job.restore_id = None
    job.state = job_next_state(JobState.STARTING, JobTrigger.UNSTART)
    job.placement, job.rendezvous, job.rendezvous_port, job.started_at = [], "", None, None
    job.error = why
    if failed:  # (the elastic scheduler backs off before it starts a queued job again)
        job.resize_failures += 1
        job.resize_failed_at = timezone.now()
    job.save()
    publish_job(job, "upsert")
