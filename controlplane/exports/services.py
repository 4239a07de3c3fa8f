"""Exports of a job's checkpoints as Hugging Face directories: a request (the web process: checks
and a row, bounded work) and the export itself (the control worker's `exports` queue: the
checkpoint's fp32 masters read through DCP, one output file at a time, by the hf_weights library).

A request names one of the job's complete checkpoints (`<checkpoint_dir>/step-*/complete.json`,
agents/runtime/checkpoints.py, or the folder it resumed from), by step, default the latest; a job
without one is a 409 ("no checkpoint yet"). The export writes `<exports root>/<job>-step-<N>/` (or
`<name>/`), first into a hidden `.<name>.partial-<id>` folder beside it that is renamed once every
file is written, so a directory of that name is always a whole export. With the job's `init_from`
the export keeps that directory's file split, names and dtypes and copies its config.json and
tokenizer files; else config.json is generated from the job's model and the weights are bf16.

One export runs at a time (the control worker's threads also apply the agents' reports); an export
that has not moved on for STALE_SECONDS (its worker was lost) is failed when the next is asked."""
from __future__ import annotations

import json
import logging
import os
import shutil
import time
from datetime import timedelta
from pathlib import Path

from django.conf import settings
from django.db import IntegrityError, transaction
from django.utils import timezone
from kombu.exceptions import OperationalError

from agents.protocol import CHECKPOINT_COMPLETE_MARKER as COMPLETE
from controlplane.common import inputs
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.common.folders import Root
from controlplane.common.weights import weights_directory, weights_root
from controlplane.exports.models import NAME_RE, NAME_RULE, Export
from controlplane.exports.selectors import export_view
from controlplane.jobs.events import ExportEvent, job_stream
from controlplane.jobs.models import Job

log = logging.getLogger(__name__)

EXPORT_TASK = "exports.run"
STALE_SECONDS = 1800.0
ACTIVE = (Export.State.PENDING, Export.State.RUNNING)


def exports_root() -> Root:
    return Root(settings.DYNAPLANE_EXPORTS_ROOT, "exports root", "DYNAPLANE_EXPORTS_ROOT")


def _checkpoint_root() -> Root:
    return Root(settings.DYNAPLANE_CHECKPOINT_ROOT, "checkpoint root", "DYNAPLANE_CHECKPOINT_ROOT")


def told(text: str) -> str:
    """A message with every absolute path under the control plane's roots told relative to them."""
    for root in (exports_root(), weights_root(), _checkpoint_root()):
        text = root.strip(text)
    return text[:4000]


def _step_of(folder: Path) -> int | None:
    try:
        meta = json.loads((folder / COMPLETE).read_text())
    except (OSError, ValueError):
        return None
    step = meta.get("step") if isinstance(meta, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


def job_checkpoints(job: Job) -> list[tuple[int, str]]:
    """(step, folder) of each complete checkpoint of the job, oldest first: the `step-*` folders
    under its checkpoint_dir with a complete.json (agents/runtime/checkpoints.py keeps the last
    three), and the checkpoint it resumed from."""
    folders: list[Path] = []
    if job.checkpoint_dir and os.path.isdir(job.checkpoint_dir):
        folders += sorted(p for p in Path(job.checkpoint_dir).glob("step-*") if (p / COMPLETE).is_file())
    if job.checkpoint_path and (Path(job.checkpoint_path) / COMPLETE).is_file():
        resumed = Path(job.checkpoint_path)
        if resumed not in folders:
            folders.insert(0, resumed)
    found = [(step, str(folder)) for folder in folders if (step := _step_of(folder)) is not None]
    return sorted(found, key=lambda item: item[0])  # (stable: a step written again by a restored world stays last)


def _publish(row: Export) -> None:
    if row.job_id is not None:
        stream = job_stream(row.job_id)
        publish_on_commit(stream, ExportEvent(seq=next_seq(stream), export=export_view(row)))


def _fail(row: Export, why: str) -> None:
    row.state, row.error, row.finished_at = Export.State.FAILED, why, timezone.now()
    row.save(update_fields=["state", "error", "finished_at", "updated_at"])
    _publish(row)


def _fail_stale(now) -> None:
    """Fail the exports that have not moved on for STALE_SECONDS (their worker was lost)."""
    before = now - timedelta(seconds=STALE_SECONDS)
    for row in Export.objects.select_for_update().filter(state__in=ACTIVE, updated_at__lt=before):
        _fail(row, f"no progress for {STALE_SECONDS / 60:.0f} min: the control worker that ran it was lost "
                   f"(or never took it from the `{settings.DYNAPLANE_EXPORTS_QUEUE}` queue)")


def export_request(*, job_id: int, checkpoint_step: int | None = None, name: str | None = None,
                   created_by=None) -> Export:
    """Queue the export of one of the job's complete checkpoints (`checkpoint_step`, default the
    latest) to `<exports root>/<name>` (default `<job>-step-<N>`). InvalidInput names
    `checkpoint_step` (no complete checkpoint of that step) or `name` (not a name, or taken);
    Conflict when the job has no checkpoint yet or another export is under way."""
    job = Job.objects.get(pk=job_id)
    found = job_checkpoints(job)
    if not found:
        why = ("its checkpoint_interval is 0 (checkpoints are off); a job with one writes a checkpoint every "
               "checkpoint_interval steps" if not job.checkpoint_interval else
               f"the first comes at step {job.checkpoint_interval} (checkpoint_interval)")
        raise Conflict(f"job {job.name!r} has no checkpoint yet: set checkpoint_interval; {why}")
    if checkpoint_step is None:
        step, folder = found[-1]
    else:
        matches = [item for item in found if item[0] == checkpoint_step]
        if not matches:
            steps = ", ".join(str(s) for s in sorted({s for s, _ in found}))
            raise InvalidInput({"checkpoint_step": [
                f"job {job.name!r} has no complete checkpoint of step {checkpoint_step} (it has step {steps}; the "
                f"last three are kept)"]})
        step, folder = matches[-1]
    if name:
        if not NAME_RE.match(name):
            raise InvalidInput({"name": [f"{name[:100]!r} is not an export name: {NAME_RULE}"]})
    else:
        name = f"{job.name}-step-{step}"
    if os.path.lexists(os.path.join(exports_root().real, name)):
        raise InvalidInput({"name": [f"{name} exists already under the exports root: give another name"]})
    try:
        with transaction.atomic():
            _fail_stale(timezone.now())
            busy = Export.objects.select_for_update().filter(state__in=ACTIVE).first()
            if busy is not None:
                raise Conflict(f"export {busy.pk} (job {busy.job_name!r}, step {busy.checkpoint_step}) is "
                               f"{busy.state}: the control worker exports one checkpoint at a time; ask again when it "
                               f"is done (GET /api/exports/{busy.pk})")
            if Export.objects.filter(path=name).exclude(state=Export.State.FAILED).exists():
                raise InvalidInput({"name": [f"{name} is an export's directory already: give another name"]})
            row = Export.objects.create(job=job, job_name=job.name, checkpoint_step=step, checkpoint_path=folder,
                                        model=job.model, source=job.init_from, path=name, created_by=created_by)
            _publish(row)
            transaction.on_commit(lambda: _dispatch(row.pk))
    except IntegrityError:  # the same directory asked for meanwhile
        raise InvalidInput({"name": [f"{name} is an export's directory already: give another name"]}) from None
    return row


def _dispatch(export_id: int) -> None:
    from controlplane.celery import app

    try:
        app.send_task(EXPORT_TASK, args=[export_id], queue=settings.DYNAPLANE_EXPORTS_QUEUE)
    except (OperationalError, OSError) as exc:
        with transaction.atomic():
            row = Export.objects.select_for_update().filter(pk=export_id, state=Export.State.PENDING).first()
            if row is not None:
                _fail(row, f"not queued: the broker refused it ({type(exc).__name__})")


def _progress(export_id: int, **fields) -> None:
    with transaction.atomic():
        row = Export.objects.select_for_update().get(pk=export_id)
        for key, value in fields.items():
            setattr(row, key, value)
        row.save(update_fields=[*fields, "updated_at"])
        _publish(row)


def _weight_bytes(folder: str) -> int:
    try:
        return sum(entry.stat().st_size for entry in os.scandir(folder) if entry.name.endswith(".safetensors"))
    except OSError:
        return 0


def export_run(*, export_id: int) -> Export | None:
    """The export task's work (the control worker, `exports` queue): pending -> running -> done,
    or failed with the reason. A row that is not pending (a redelivered task) is left alone."""
    with transaction.atomic():
        row = Export.objects.select_for_update().filter(pk=export_id).first()
        if row is None or row.state != Export.State.PENDING:
            log.info("export %s: not pending (%s), not run again", export_id, row.state if row else "deleted")
            return row
        row.state, row.started_at = Export.State.RUNNING, timezone.now()
        row.save(update_fields=["state", "started_at", "updated_at"])
        _publish(row)
    started = time.perf_counter()
    root = exports_root().real
    final = os.path.join(root, row.path)
    partial = os.path.join(root, f".{row.path}.partial-{row.pk}")
    try:
        written = _write(row, partial)
        if os.path.lexists(final):
            raise FileExistsError(f"{row.path} appeared under the exports root meanwhile; the export is not moved "
                                  f"over it")
        os.rename(partial, final)
    except Exception as exc:  # every failure is the row's error, never the worker's
        shutil.rmtree(partial, ignore_errors=True)
        why = told(str(exc)) if isinstance(exc, (ValueError, OSError, InvalidInput)) else \
            f"{type(exc).__name__}: {told(str(exc))}"
        log.warning("export %s of job %s failed: %s", row.pk, row.job_name, why)
        with transaction.atomic():
            row = Export.objects.select_for_update().get(pk=export_id)
            row.seconds = time.perf_counter() - started
            row.save(update_fields=["seconds"])
            _fail(row, why or type(exc).__name__)
        return row
    _progress(export_id, state=Export.State.DONE, files_written=written, bytes=_weight_bytes(final),
              seconds=time.perf_counter() - started, finished_at=timezone.now())
    return Export.objects.get(pk=export_id)


def _write(row: Export, out_dir: str) -> int:
    """Write the export into out_dir (removed first if a failed try left it); the number of
    weight files written. Progress (files written, their bytes) is saved as each file begins."""
    from parallelism.hf_weights import plan_export, read_checkpoint_masters
    from parallelism.hf_weights.export import write_export
    from parallelism.hf_weights.gather import check_checkpoint
    from parallelism.layout.catalog import model_from_config

    config = inputs.model_config(row.model)
    source = weights_directory(row.source) if row.source else None
    plan = plan_export(config, source_dir=source)
    model = model_from_config(plan.config)
    check_checkpoint(row.checkpoint_path, model)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    total = plan.file_count
    _progress(row.pk, files_total=total)
    calls = [0]

    def fetch(names):
        if calls[0]:  # (write_export fetches each file's tensors before writing it: those before are written)
            _progress(row.pk, files_written=calls[0], bytes=_weight_bytes(out_dir))
        calls[0] += 1
        return read_checkpoint_masters(row.checkpoint_path, model, names)

    write_export(plan, out_dir, fetch)
    return total
