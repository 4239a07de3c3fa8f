"""Emulation runs: create and dispatch to the agents' `emulate` queue, record progress."""
from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from agents import protocol
from agents.liveness import TAKEN
from parallelism.layout.catalog import model_from_config
from controlplane.cluster.lifecycle import NodeState
from controlplane.cluster.liveness import last_heard, later
from controlplane.cluster.models import Node
from controlplane.common import inputs
from controlplane.common.errors import InvalidInput
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.emulation.events import GROUP, STREAM, EmulationEvent, EmulationView
from controlplane.emulation.models import EmulationRun


def emulation_view(run: EmulationRun) -> EmulationView:
    return EmulationView(id=run.pk, model=run.model, layout=run.layout, gpus=run.gpus, gpu_type=run.gpu_type,
                         global_batch=run.global_batch, micro_batch=run.micro_batch, seq_len=run.seq_len,
                         recompute=run.recompute, state=run.state, message=run.message, error=run.error, result=run.result or None,
                         wall_seconds=run.wall_seconds, kind=run.kind, top=run.top)


def _emit(run: EmulationRun) -> None:
    publish_on_commit(GROUP, EmulationEvent(seq=next_seq(STREAM), run=emulation_view(run)))


def check_config(config: dict) -> list[str]:
    """What is wrong with one configuration, as field-named messages (empty when fine): the
    same rules as a job's (controlplane/common/inputs.py). The emulator checks again; these
    are the mistakes worth a 400 before queueing."""
    try:
        model = inputs.model_config(config["model"])
        placement = inputs.placement_of(model_from_config(model), config["layout"])
    except InvalidInput as exc:
        return [f"{field}: {' '.join(messages)}" for field, messages in exc.errors.items()]
    problems = []
    if placement.world != config["gpus"]:
        problems.append(f"gpus: layout {config['layout']} needs {placement.world} GPUs, not {config['gpus']}")
    problems += [f"{field}: {' '.join(messages)}" for field, messages in inputs.training_problems(
        model, placement, global_batch=config["global_batch"], micro_batch=config["micro_batch"],
        seq_len=config["seq_len"]).items()]
    return problems


def emulation_create(*, configs: list[dict], created_by=None) -> list[EmulationRun]:
    """Store one queued run per configuration and send each to the `emulate` queue once the
    transaction commits. All or nothing: one bad configuration refuses the request."""
    errors = {f"configs[{i}]": problems for i, c in enumerate(configs) if (problems := check_config(c))}
    if errors:
        raise InvalidInput(errors)
    with transaction.atomic():
        runs = [EmulationRun.objects.create(
            model=c["model"], layout=c["layout"], gpus=c["gpus"], gpu_type=c["gpu_type"],
            global_batch=c["global_batch"], micro_batch=c["micro_batch"], seq_len=c["seq_len"],
            recompute=c["recompute"], created_by=created_by) for c in configs]
        for run in runs:
            _emit(run)
            order = protocol.EmulationOrder(run_id=run.pk, model=run.model, layout=run.layout, gpus=run.gpus,
                                            gpu=run.gpu_type, global_batch=run.global_batch,
                                            micro_batch=run.micro_batch, seq=run.seq_len, recompute=run.recompute)
            transaction.on_commit(lambda order=order: _dispatch(order))
    return runs


def emulation_search_create(*, config: dict, top: int, created_by=None) -> EmulationRun:
    """Store a queued search for one setting (`config` without a layout) and send it to the
    `emulate` queue on commit: an agent ranks the layouts worth emulating and reports them
    as the run's result (parallelism/emulator/search_candidates.py); the web process never runs
    the emulator."""
    problems = {}
    try:
        inputs.model_config(config["model"])
    except InvalidInput as exc:
        problems.update(exc.errors)
    if config["global_batch"] % config["micro_batch"]:
        problems["global_batch"] = [f"{config['global_batch']} is not a multiple of micro_batch "
                                    f"{config['micro_batch']}"]
    if not 1 <= top <= protocol.SEARCH_TOP_MAX:
        problems["top"] = [f"{top} is not from 1 to {protocol.SEARCH_TOP_MAX}"]
    if problems:
        raise InvalidInput(problems)
    with transaction.atomic():
        run = EmulationRun.objects.create(
            kind=EmulationRun.Kind.SEARCH, top=top, model=config["model"], layout="", gpus=config["gpus"],
            gpu_type=config["gpu_type"], global_batch=config["global_batch"], micro_batch=config["micro_batch"],
            seq_len=config["seq_len"], recompute=config["recompute"], created_by=created_by)
        _emit(run)
        order = protocol.SearchOrder(run_id=run.pk, model=run.model, gpus=run.gpus, gpu=run.gpu_type,
                                     global_batch=run.global_batch, micro_batch=run.micro_batch, seq=run.seq_len,
                                     recompute=run.recompute, top=top)
        transaction.on_commit(lambda: _dispatch(order, task=protocol.EMULATE_SEARCH))
    return run


def _dispatch(order: protocol.EmulationOrder | protocol.SearchOrder, task: str = protocol.EMULATE_RUN) -> None:
    from controlplane.celery import app

    app.send_task(task, args=[order.model_dump(mode="json")], queue=protocol.EMULATE_QUEUE)


def emulation_record_progress(*, progress: protocol.EmulationProgress) -> EmulationRun | None:
    """Apply an agent's report. Reports of a finished run are ignored (a late 'running'
    message must not reopen it); a run that no longer exists is ignored."""
    with transaction.atomic():
        run = EmulationRun.objects.select_for_update().filter(pk=progress.run_id).first()
        if run is None or run.state in (EmulationRun.State.DONE, EmulationRun.State.FAILED):
            return run
        run.state = progress.state
        run.message = progress.message or run.message
        if progress.state == "done":
            run.result = progress.result or {}
        if progress.state == "failed":
            run.error = progress.error or "failed without a reason"
        if progress.state in ("done", "failed"):
            run.finished_at = timezone.now()
            run.wall_seconds = progress.wall_seconds
        run.save()
        _emit(run)
    return run


def emulations_reconcile(*, grace: timedelta | None = None) -> list[int]:
    """The beat's sweep: fail the `running` runs that no healthy agent reports working on
    (their agent died or restarted), once every agent has reported `grace` after the run's
    last change (an agent reports what it works on from the moment it takes a run up);
    returns their ids. (Jobs: controlplane/jobs/reconcile.py.)"""
    grace = timedelta(seconds=settings.DYNAPLANE_RECONCILE_GRACE_SECONDS) if grace is None else grace
    if not EmulationRun.objects.filter(state=EmulationRun.State.RUNNING).exists():
        return []  # (the usual case: nothing to read about a thousand nodes for)
    seen = list(Node.objects.filter(state=NodeState.HEALTHY).only("name", "last_heartbeat", "running_emulations"))
    working = {int(run) for node in seen for run in (node.running_emulations or [])}
    taken = last_heard([n.name for n in seen], which=TAKEN)  # (unchanged heartbeats since the row's: liveness.py)
    oldest_report = min((later(n.last_heartbeat, taken.get(n.name)) for n in seen if n.last_heartbeat), default=None)
    if oldest_report is None:
        return []
    return emulation_fail_unseen(working=working, before=oldest_report - grace,
                                 why="no agent works on it any more (its agent stopped or restarted)")


def emulation_fail_unseen(*, working: set[int], before, why: str) -> list[int]:
    """Fail the `running` runs unchanged since before `before` that no agent reports working
    on; returns their ids. A finished one is left alone."""
    failed = []
    with transaction.atomic():
        stale = (EmulationRun.objects.select_for_update().filter(state=EmulationRun.State.RUNNING,
                                                                 updated_at__lt=before)
                 .exclude(pk__in=working))
        for run in stale:
            run.state, run.error, run.finished_at = EmulationRun.State.FAILED, why, timezone.now()
            run.save(update_fields=["state", "error", "finished_at", "updated_at"])
            _emit(run)
            failed.append(run.pk)
    return failed
