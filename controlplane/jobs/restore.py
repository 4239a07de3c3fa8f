"""Recovery of a job whose ranks were lost: go on on the surviving ranks' memory when they
may (survivors.py), else restart it from its latest checkpoint on the GPUs it still has
(docs/elastic.md, "Failures and recovery").

Two steps, because the cause is often known late: a rank that dies takes its peers down
at once (gloo reports the broken connection); they wait with their state and their agent
reports them `orphaned` (or `failed`, for a rank that died) seconds before the heartbeat
sweep marks the dead node lost.
1. restore_begin (in the orphan, failure or node-loss transaction): a job with a checkpoint,
   or whose other ranks may take over, goes `restoring` (job.recovery keeps the cause,
   whether a transition was active, the waiting ranks and the nodes that failed); its
   active resize ends aborted, saying so; a `control.job_restore` task is queued to run
   once a dead node has surely been marked lost (lost-after + 2 heartbeats), soon when the
   loss is already known; when the sweep found a node silent (a cut link) and the others may
   take over, once their step's collectives have timed out (the step timeout + 2 heartbeats),
   with an early look at their first report.
2. job_restore (that task): parallelism.layout.recovery decides. Survivors: survivors.py. Else
   the checkpoint: the job's GPUs on healthy nodes are the survivors; the layout
   for their count follows the resize rule (resize.layout_for_resize); the ranks are placed
   on them (TP blocks on one node), a `restore` transition records what happens (reason:
   "node node-2 lost at step 14; restored from checkpoint step 10 (4 steps redone)"), and
   every node gets a JobStartOrder with `restore_from` (the agents replace the ranks still
   there). restoring -> starting; the new world's `restored` report commits the row.
Else the job fails, saying why; so does a second failure before a newer checkpoint than
the one the last checkpoint restore loaded (no restore loops).
"""
from __future__ import annotations

import logging
from collections import defaultdict

from django.conf import settings
from django.db import transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from agents import protocol
from parallelism.layout.placement import tp_block
from parallelism.layout.allocate import AllocationError, FreeGpus, allocate
from parallelism.layout.recovery import CHECKPOINT, FAIL, SURVIVORS, Recovery, recovery_rule, survivors_cover
from controlplane.cluster.agent_auth import control_seal
from controlplane.cluster.lifecycle import GpuState, NodeState
from controlplane.cluster.models import Gpu
from controlplane.celery import app
from controlplane.cluster.services import gpus_release
from controlplane.common import inputs
from controlplane.common.errors import Conflict
from controlplane.jobs import transitions
from controlplane.jobs.failures import job_fail, send_starts_on_commit
from controlplane.jobs.layouts import layout_for_resize
from controlplane.jobs.lifecycle import (JobState, JobTrigger, TransitionKind, TransitionState, job_next_state,
                                        restore_next_state)
from controlplane.jobs.models import Job, Transition
from controlplane.jobs.orders import free_port, rendezvous_address, start_orders, stop_on_commit
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.jobs.events import RewindEvent, job_stream
from controlplane.jobs.services import job_metrics_truncate, layout_check, publish_job
from controlplane.jobs.survivors import survivors_switch

log = logging.getLogger(__name__)

EARLY_LOOK_SECONDS = 2 * protocol.HEARTBEAT_SECONDS  # after the first loss report, when the survivors may go on


def no_restore_reason(job: Job) -> str | None:
    """Why the job cannot be restored from a checkpoint (None: it can)."""
    if job.checkpoint_step is None or not job.checkpoint_path:
        return ("no checkpoint to restore from" if job.checkpoint_interval
                else "no checkpoint to restore from (checkpoint_interval=0: checkpoints are off)")
    if job.restored_step is not None and job.restored_step >= job.checkpoint_step:
        return (f"the restore from checkpoint step {job.restored_step} failed too before a newer checkpoint; "
                f"not restoring again")
    return None


def _ranks_off(job: Job, nodes: set[str]) -> set[int]:
    return {slot["rank"] for slot in job.placement if slot["node"] not in nodes}


def survivors_note(job: Job, alive: set[tuple[str, int]]) -> str:
    """Whether the job's old ranks on the surviving GPUs still held every state element of
    its layout (parallelism.layout.survivors), said in a checkpoint restore's row."""
    ranks = {slot["rank"] for slot in job.placement if (slot["node"], slot["gpu"]) in alive}
    missing = survivors_cover(layout_check(model=inputs.model_of(job.model), layout=job.layout), ranks)
    return missing or f"the surviving ranks ({len(ranks)} of {job.world_size}) still held a full replica of the state"


def restore_begin(job: Job, *, cause: str, known_lost: bool, lost_nodes: set[str] | None = None,
                  detail: str = "", went_silent: bool = False) -> bool:
    """The locked live job lost ranks (`cause` says how, `detail` with the error when there
    is one; `lost_nodes`: where, when known; `went_silent`: the heartbeat sweep found those
    nodes silent, so their peers learn it only when a step's collective times out).
    It can recover when it has a checkpoint, or when its ranks elsewhere may take over
    (no transition active and they hold every state element; parallelism.layout.recovery):
    -> restoring, the recovery task queued, True. Else False (the caller fails it)."""
    if job.state == JobState.RESTORING:
        if lost_nodes:
            restore_record_lost(job, lost_nodes, silent=went_silent)
        return True
    if job.state == JobState.STOPPING:
        return False
    eligible = transitions.active_transition(job) is None
    # Known lost before any rank reported waiting: ranks that outlived their world report
    # within a second or two of a closed connection, long before a node counts as lost, so
    # none will, but for a node that went silent (a cut link sends no reset): its peers find
    # out when their step's collective times out (the orders' step_timeout_seconds), after
    # the sweep. Otherwise decide now, as without survivors.
    possible = eligible and (went_silent or not known_lost) and not survivors_cover(
        layout_check(model=inputs.model_of(job.model), layout=job.layout), _ranks_off(job, lost_nodes or set()))
    if no_restore_reason(job) is not None and not possible:
        return False
    if no_restore_reason(job) is None:
        why = f"{cause}; restoring from checkpoint step {job.checkpoint_step}"
        why += " unless the surviving ranks take over" if possible else ""
    else:
        why = f"{cause}; recovering on the surviving ranks if they outlived their world (no checkpoint)"
    transitions.end_with_restore(job, why)
    job.state = job_next_state(JobState(job.state), JobTrigger.RESTORE)
    job.error = why[:4000]
    job.recovery = {"cause": cause, "detail": detail[:3000], "eligible": eligible, "orphans": [],
                    "failed_nodes": sorted(lost_nodes or ()),
                    "silent_nodes": sorted(lost_nodes or ()) if went_silent else []}
    job.save(update_fields=["state", "error", "recovery", "updated_at"])
    publish_job(job, "upsert")
    # A dead node is marked lost lost-after + 2 heartbeats after it stopped: decide then. When
    # the survivors may take over, a first look comes sooner: the ranks that outlived their
    # world have usually all reported by then, and if they may go on they need not wait for
    # the sweep (the dead node's ranks are left out either way). It acts only if no rank
    # beside a reporting one is still silent (unreported_beside); else the final look decides.
    if known_lost:  # (the survivors of a silent node report by the step timeout; their first report looks early)
        delay = settings.DYNAPLANE_STEP_TIMEOUT_SECONDS + 2 * protocol.HEARTBEAT_SECONDS if possible else 0.5
    else:
        delay = settings.DYNAPLANE_NODE_LOST_AFTER_SECONDS + 2 * protocol.HEARTBEAT_SECONDS
    if possible and EARLY_LOOK_SECONDS < delay:
        transaction.on_commit(lambda: _queue_restore(job.pk, EARLY_LOOK_SECONDS, early=True))
    transaction.on_commit(lambda: _queue_restore(job.pk, delay))
    log.warning("job %s: %s (in %.1f s)", job.name, why, delay)
    return True


def restore_record_lost(job: Job, nodes: set[str], *, silent: bool = False) -> None:
    """Nodes whose agents reported a failure of the job's ranks (and killed the job's ranks
    there), or that went silent (`silent`), while it is restoring: their waiting ranks, if
    any, are gone."""
    recovery = dict(job.recovery or {})
    recovery["failed_nodes"] = sorted({*recovery.get("failed_nodes", []), *nodes})
    if silent:
        recovery["silent_nodes"] = sorted({*recovery.get("silent_nodes", []), *nodes})
    job.recovery = recovery
    job.save(update_fields=["recovery", "updated_at"])


def restore_record_orphan(job: Job, report: protocol.JobOrphaned) -> None:
    """`orphaned` from an agent (job locked): its ranks outlived their world after `step`
    and wait with their state. The first one starts the recovery (the decision waits until
    a dead node has surely been marked lost)."""
    if job.state == JobState.STOPPING:  # its ranks are leaving anyway
        log.info("ignored orphaned report from %s: job %s is stopping", report.node, job.name)
        return
    if job.state == JobState.RESTORING and not (job.recovery or {}).get("orphans") and (job.recovery or {}).get("eligible"):
        # A silent node's peers, after their step timeout: they need not wait for the final look.
        transaction.on_commit(lambda: _queue_restore(job.pk, EARLY_LOOK_SECONDS, early=True))
    if job.state != JobState.RESTORING:
        ranks = ", ".join(map(str, report.ranks))
        cause = f"node {report.node} ranks {ranks} lost their peers ({report.error[:300] or 'no error given'})"
        if not restore_begin(job, cause=cause, known_lost=False):
            job_fail(job_id=job.pk, error=f"{cause}; {no_restore_reason(job) or f'the job was {job.state}'}")
            return
    recovery = dict(job.recovery or {})
    known = {o["rank"] for o in recovery.get("orphans", [])}
    recovery["orphans"] = [*recovery.get("orphans", []), *({"rank": r, "node": report.node, "step": report.step}
                                                           for r in report.ranks if r not in known)]
    job.recovery = recovery
    job.save(update_fields=["recovery", "updated_at"])


def restore_order(job_id: int, early: bool) -> dict:
    """What the control plane's seal on a queued restore covers (tasks.job_restore checks it)."""
    return {"job_id": job_id, "early": early}


def _queue_restore(job_id: int, delay: float, *, early: bool = False) -> None:
    try:
        app.send_task(protocol.CONTROL_JOB_RESTORE, args=[job_id, early], queue=protocol.CONTROL_FLOWS_QUEUE,
                      kwargs={"seal": control_seal(protocol.CONTROL_JOB_RESTORE, restore_order(job_id, early))},
                      countdown=delay)
    except (OperationalError, OSError) as exc:
        log.error("job %s: restore task not queued: %s", job_id, exc)
        job_fail(job_id=job_id, error=f"the restore could not be queued: {exc}")


def unreported_beside(placement: list[dict], orphans: dict[int, int], alive: set[tuple[str, int]]) -> list[int]:
    """Ranks on a live GPU of a node some of whose ranks reported waiting, that have not
    reported themselves (pure). Such a node is up, so these ranks are most likely still
    finding out that their world is gone (on a busy host a rank can take seconds longer than
    its neighbour): the first look must not switch the job on the others without them."""
    reporting = {slot["node"] for slot in placement if slot["rank"] in orphans}
    return sorted(slot["rank"] for slot in placement if slot["node"] in reporting and slot["rank"] not in orphans
                  and (slot["node"], slot["gpu"]) in alive)


def _live_orphans(job: Job, alive: list[Gpu]) -> dict[int, int]:
    """Rank -> step of the ranks that reported waiting with their state and are still there:
    on a healthy node whose agent did not report a failure (it kills the job's ranks), on
    a GPU the job still holds."""
    recovery = job.recovery or {}
    failed = set(recovery.get("failed_nodes", []))
    gpus = {(g.node.name, g.index) for g in alive}
    slot_of = {slot["rank"]: slot for slot in job.placement}
    return {o["rank"]: o["step"] for o in recovery.get("orphans", [])
            if o["rank"] in slot_of and slot_of[o["rank"]]["node"] == o["node"] and o["node"] not in failed
            and (o["node"], slot_of[o["rank"]]["gpu"]) in gpus}


def job_restore(*, job_id: int, early: bool = False) -> Transition | None:
    """Recover a restoring job (parallelism.layout.recovery): on its surviving ranks without a
    checkpoint when they may (survivors.py), else restart it from its latest checkpoint on
    its GPUs of healthy nodes, else fail it. Returns the restore transition. `early`: the
    first look, which acts only when the survivors take over (the final one decides)."""
    with transaction.atomic():
        job = Job.objects.select_for_update().filter(pk=job_id).first()
        if job is None or job.state != JobState.RESTORING:
            return None
        recovery = job.recovery or {}
        cause = recovery.get("cause") or job.error.rpartition("; restoring from")[0] or job.error
        held = list(Gpu.objects.select_for_update(of=("self",)).select_related("node").filter(job=job).order_by("id"))
        alive = [g for g in held if g.node.state == NodeState.HEALTHY and g.state == GpuState.ALLOCATED]
        old_nodes = list(dict.fromkeys([*job.nodes, *(g.node.name for g in held)]))
        orphans = _live_orphans(job, alive)
        model = inputs.model_of(job.model)
        rule = recovery_rule(layout_check(model=model, layout=job.layout), orphans,
                             transition_active=not recovery.get("eligible", False), no_checkpoint=no_restore_reason(job))
        if early and rule.action != SURVIVORS:
            log.info("job %s: not on the survivors yet (%s); deciding once lost nodes are known", job.name, rule.why)
            return None
        if early and (silent := unreported_beside(job.placement, orphans, {(g.node.name, g.index) for g in alive})):
            log.info("job %s: ranks %s, on nodes whose other ranks reported waiting, have not reported yet; "
                     "deciding once lost nodes are known", job.name, silent)
            return None
        if rule.action == SURVIVORS:
            row = survivors_switch(job, rule.world, step=max(orphans.values()), cause=cause)
            if isinstance(row, Transition):
                return row
            if early:
                return None
            why = f"the survivors cannot run the job: {row}"
            rule = (Recovery(CHECKPOINT, why) if no_restore_reason(job) is None
                    else Recovery(FAIL, f"{no_restore_reason(job)}; {why}"))
        if rule.action == FAIL:
            transaction.on_commit(lambda: log.error("job %s: recovery failed: %s", job.name, rule.why))
            # Not the nodes whose agents killed the job's ranks, but those that went silent: one
            # cut off that comes back finds the stop queued, and its ranks waiting for a recovery order leave.
            failed = set(recovery.get("failed_nodes", [])) - set(recovery.get("silent_nodes", []))
            job_fail(job_id=job.pk, error=f"{recovery.get('detail') or cause}; {rule.why}",
                     notify=[n for n in old_nodes if n not in failed])
            return None
        failure = None
        layout = layout_for_resize(job, len(alive), model) if alive else ""
        slots = []
        if not alive:
            failure = "no GPU of the job is left on a healthy node"
        else:
            try:
                placement = layout_check(model=model, layout=layout)
                by_node: dict[str, list[int]] = defaultdict(list)
                for gpu in alive:
                    by_node[gpu.node.name].append(gpu.index)
                slots = allocate(placement.world, tp_block(placement),
                                 [FreeGpus(node, tuple(ix)) for node, ix in by_node.items()])
                port = free_port(next(g.node.host for g in alive if g.node.name == slots[0].node))
            except (AllocationError, Conflict, Exception) as exc:  # InvalidInput names the broken rule
                failure = f"{len(alive)} surviving GPUs cannot run the job ({layout}): {exc}"
        if failure is not None:
            transaction.on_commit(lambda: log.error("job %s: restore failed: %s", job.name, failure))
            job_fail(job_id=job.pk, error=f"{cause}; cannot restore: {failure}", notify=old_nodes)
            return None
        used = {(s.node, s.gpu) for s in slots}
        gpus_release(gpus=Gpu.objects.filter(job=job).exclude(pk__in=[g.pk for g in held
                                                                        if (g.node.name, g.index) in used]))
        host = next(g.node.host for g in alive if (g.node.name, g.index) == (slots[0].node, slots[0].gpu))
        redone = max(0, (job.step or 0) - job.checkpoint_step)
        reason = (f"{cause} at step {max(job.step or 0, job.checkpoint_step)}; restored from checkpoint step "
                  f"{job.checkpoint_step} ({redone} steps redone) on {len(slots)} GPUs as {layout}")
        note = survivors_note(job, {(g.node.name, g.index) for g in alive})
        held = note.endswith("full replica of the state")  # then say why they did not take over
        reason += "; " + note + (f"; not switched on them: {rule.why}" if held else "")
        source_placement, source_layout, source_world = job.placement, job.layout, job.world_size
        job.placement = [{"rank": s.rank, "node": s.node, "gpu": s.gpu} for s in slots]
        job.layout, job.world_size = layout, len(slots)
        job.rendezvous = rendezvous_address(host, port)
        job.rendezvous_port = port
        row = Transition.objects.create(
            job=job, kind=TransitionKind.RESTORE, source_layout=source_layout, destination_layout=layout,
            source_world=source_world, destination_world=len(slots), source_placement=source_placement,
            destination_placement=job.placement, rendezvous=job.rendezvous, step=job.checkpoint_step,
            reason=reason, history=[{"state": "planned", "at": timezone.now().isoformat(), "reported": False}],
            verification={"checkpoint": job.checkpoint_path, "checkpoint_step": job.checkpoint_step})
        job.restore_id, job.restored_step = row.pk, job.checkpoint_step
        job.error, job.recovery = "", {}
        job.state = job_next_state(JobState.RESTORING, JobTrigger.RESTART)
        job.save()
        publish_job(job, "upsert")
        transitions.publish_transition(row)
        orders = start_orders(job)
        stop_on_commit(job, [n for n in old_nodes if n not in orders])
        send_starts_on_commit(job, orders)
        log.warning("job %s: %s", job.name, reason)
    return row


def restore_record_report(job: Job, report: protocol.JobRestored) -> None:
    """`restored` from rank 0 of the new world (job locked): the restore row commits with
    what the ranks checked (the loaded state's digests against the saved ones)."""
    row = Transition.objects.select_for_update().filter(pk=report.restore_id, job=job,
                                                        kind=TransitionKind.RESTORE).first()
    if row is None or row.state != TransitionState.PLANNED:
        log.info("ignored restored report for job %s: restore %s is not planned", job.name, report.restore_id)
        return
    transitions.enter(row, restore_next_state(TransitionState.PLANNED, TransitionState.COMMITTED), reported=True)
    row.verification = {**row.verification, "verified": report.verified, "node": report.node}
    row.transfer_seconds = report.seconds
    row.save()
    transitions.publish_transition(row)
    if report.verified is False:
        log.error("job %s: restore %s loaded a state whose digests differ from the checkpoint's", job.name, row.pk)
    rewind(job, report.step)


def rewind(job: Job, step: int) -> None:
    """The job's record goes back to `step`, the checkpoint its ranks restarted from: the steps
    recorded after it are gone from its series (the weights never kept them) and the retrained
    ones append in their place, so the series is the trajectory the weights took (issue 43).
    The page drops them on the `rewind` event; the restore row marks the place."""
    if job.step is None or job.step <= step:
        return
    removed = job_metrics_truncate(job=job, after_step=step)
    log.warning("job %s: its record rewound from step %s to checkpoint step %s (%d points of its series), the "
                "steps after it trained again", job.name, job.step, step, removed)
    job.step = step
    job.save(update_fields=["step", "updated_at"])
    stream = job_stream(job.pk)
    publish_on_commit(stream, RewindEvent(seq=next_seq(stream), job=job.pk, step=step))
