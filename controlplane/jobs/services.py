"""Writes to jobs: create, delete, publish, and the metric store. Scheduling onto the
node agents (start, stop, reports) is in scheduling.py and reports.py."""
from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from django.conf import settings
from django.db import connection, transaction

from parallelism.layout.catalog import model_from_config
from parallelism.layout.errors import LayoutError
from parallelism.layout.placement import Placement, hetero_refusal
from parallelism.layout.spec import parse_layout
from parallelism.layout.tensors import Model
from controlplane.cluster.events import GROUP, STREAM, JobEvent
from controlplane.cluster.selectors import inventory_capacity, job_view
from controlplane.cluster.services import gpus_release
from controlplane.common import inputs
from controlplane.common.errors import Conflict, InvalidInput
from controlplane.common.events import next_seq, publish_on_commit
from controlplane.common.weights import check_initial_weights, initial_model_name, initial_weights, store_initial_model
from controlplane.datasets.selectors import dataset_of, dataset_samples_per_epoch, dataset_validation_samples
from controlplane.jobs.elastic_range import range_problems
from controlplane.jobs.elastic_trigger import elastic_nudge
from controlplane.jobs.lifecycle import DELETABLE_JOB_STATES
from controlplane.jobs.metric_codec import CHUNK_POINTS, pack, unpack
from controlplane.jobs.models import DEFAULT_CHECKPOINT_INTERVAL, Job, MetricChunk, MetricSeries, Transition
from controlplane.jobs.resume import checkpoint_info


def publish_job(job: Job, op: str) -> None:
    """The job's new state, on commit, to the cluster stream; and, since every change of a
    job passes here, a nudge to the elastic scheduler (elastic_trigger: a no-op unless it
    has elastic or queued jobs to act on)."""
    publish_on_commit(GROUP, JobEvent(op=op, seq=next_seq(STREAM), job=job_view(job)))
    elastic_nudge(f"job {job.name} {job.state}" if op == "upsert" else f"job {job.name} removed")


def layout_for_gpus(*, model: str, gpus: int) -> str:
    """The layout the control plane picks for `gpus` GPUs. For now one rule for every model:
    pure data parallelism, dp=gpus (docs/elastic.md); the emulator-backed policy replaces it."""
    return f"dp={gpus}"


def _capacity_problems(config, placement: Placement, *, micro_batch: int, seq_len: int,
                       field: str) -> dict[str, list[str]]:
    """A job must fit the cluster: no more GPUs than the inventory has, and (estimated, see
    parallelism/layout/job_memory.py) no more memory per GPU than its smallest GPU holds. (An
    empty inventory, before the first agent registers, has nothing to compare with.)"""
    from parallelism.layout.job_memory import estimate
    from controlplane.cluster.selectors import inventory_capacity

    gpus, smallest = inventory_capacity()
    if gpus and placement.world > gpus:
        return {field: [f"the layout {placement.layout} spans {placement.world} GPUs; the cluster has {gpus}"]}
    need = estimate(config, placement, micro_batch, seq_len)
    if smallest and need.total_bytes > smallest:
        which = "seq_len" if need.activation_bytes > need.state_bytes else field
        return {which: [f"predicted {need.total_bytes / 2**30:.1f} GiB per GPU (model state "
                        f"{need.state_bytes / 2**30:.1f} GiB + activations {need.activation_bytes / 2**30:.1f} GiB at "
                        f"seq_len={seq_len}, micro_batch={micro_batch}) exceeds the smallest GPU's "
                        f"{smallest / 2**30:.1f} GiB"]}
    return {}


def layout_check(*, model: Model, layout: str) -> Placement:
    """The model's placement under the layout; InvalidInput names the broken rule."""
    placement = inputs.placement_of(model, layout)
    refused = None
    if len(placement.model.modules) > 1:  # multimodal: the heterogeneous trainer's rules
        refused = hetero_refusal(placement)
    if refused:
        raise InvalidInput({"layout": [refused]})
    return placement


# What job_check answers beside the Job fields (job_create takes them out).
CHECK_EXTRAS = ("validation_samples", "initial_weights")


def job_check(
    *, name: str, model: str | None = None, layout: str | None = None, gpus: int | None = None,
    global_batch: int = 8, micro_batch: int = 1, seq_len: int = 128, max_steps: int | None = None,
    checkpoint_interval: int | None = None, checkpoint_dir: str = "", resume_from: str = "",
    elastic: bool = False, min_gpus: int | None = None, max_gpus: int | None = None, priority: int = 0,
    dataset: str | None = None, eval_every: int = 0, eval_batches: int = 4, init_from: str | None = None,
) -> dict:
    """Every rule a new job passes, without writing anything: the fields job_create stores
    (layout resolved from `gpus`, world_size, folders made absolute, checkpoint_step of a
    resume, `init_from` relative to the weights root, the model a job starting from `init_from`
    without a `model` trains), plus CHECK_EXTRAS (the validation split's samples, the checked
    initial weights), or InvalidInput naming the field and the rule. POST /api/jobs/validate
    answers with this, so the "New job" form shows the API's own refusals before it submits."""
    if (layout is None) == (gpus is None):
        raise InvalidInput({"layout": ["give either a layout or a number of gpus, not both or neither"]})
    problems: dict[str, list[str]] = {}
    weights, model_given = None, bool(model)
    if init_from not in (None, ""):
        try:
            weights = initial_weights(init_from)
        except InvalidInput as exc:
            if not model_given:  # (no model to check the rest with)
                raise
            problems.update(exc.errors)
    if model_given:
        config = inputs.model_config(model)
    elif weights is not None:
        config = weights.config
        model = initial_model_name(weights)[0]
    else:
        raise InvalidInput({"model": ["give a model (a catalog name or a stored model), or `init_from` (a Hugging "
                                      "Face model directory: the job trains the model its config.json describes)"]})
    spec = model_from_config(config)  # resolved once: every check below sees this config
    if weights is not None:
        if resume_from:
            problems["init_from"] = ["a job starts from initial weights or resumes from a checkpoint (resume_from), "
                                     "not both"]
        else:
            try:
                check_initial_weights(weights, spec)
            except InvalidInput as exc:
                problems.update(exc.errors)
    if layout is None:
        layout = layout_for_gpus(model=model, gpus=gpus)
    try:
        parsed = parse_layout(layout)
    except LayoutError as exc:
        raise InvalidInput({"gpus" if gpus is not None else "layout": [str(exc)]}) from None
    if checkpoint_interval is not None and checkpoint_interval < 0:
        raise InvalidInput({"checkpoint_interval": [f"{checkpoint_interval} is negative (0 turns checkpoints off)"]})
    checkpoint_dir = inputs.checkpoint_folder(checkpoint_dir, "checkpoint_dir") if checkpoint_dir else ""
    resume_from = inputs.checkpoint_folder(resume_from, "resume_from") if resume_from else ""
    placement = layout_check(model=spec, layout=str(parsed))
    if gpus is not None and placement.world != gpus:
        raise InvalidInput({"gpus": [f"layout {parsed} spans {placement.world} GPUs, not {gpus}"]})
    problems.update(inputs.training_problems(config, placement, global_batch=global_batch, micro_batch=micro_batch,
                                             seq_len=seq_len))
    problems.update(_capacity_problems(config, placement, micro_batch=micro_batch, seq_len=seq_len,
                                       field="gpus" if gpus is not None else "layout"))
    problems.update(range_problems(min_gpus=min_gpus, max_gpus=max_gpus, world_size=placement.world,
                                   cluster_gpus=inventory_capacity()[0]))
    data, samples_per_epoch = None, None
    if dataset not in (None, ""):
        data = dataset_of(dataset)
        why = _dataset_problem(config, data)
        if why is None and "seq_len" not in problems:
            try:
                samples_per_epoch = dataset_samples_per_epoch(data, seq_len)
            except InvalidInput as exc:
                why = exc.errors["dataset"][0]
        if why is not None:
            problems["dataset"] = [why]
    validation_samples = None
    if eval_every:
        why = _evaluation_problem(data, eval_every=eval_every, eval_batches=eval_batches, global_batch=global_batch,
                                  seq_len=seq_len, checked="dataset" not in problems and "seq_len" not in problems)
        if isinstance(why, str):
            problems["eval_every"] = [why]
        else:
            validation_samples = why
    if problems:
        raise InvalidInput(problems)
    resumed = checkpoint_info(path=resume_from, model=spec) if resume_from else None
    if resumed and max_steps is not None and max_steps <= resumed["step"]:
        raise InvalidInput({"max_steps": [f"max_steps={max_steps} is not after the checkpoint's step "
                                          f"{resumed['step']} (steps count from 0 across the resume)"]})
    if Job.objects.filter(name=name).exists():
        raise InvalidInput({"name": [f"a job named {name!r} already exists"]})
    return dict(
        name=name, model=model, layout=str(parsed), world_size=placement.world, global_batch=global_batch,
        micro_batch=micro_batch, seq_len=seq_len, max_steps=max_steps,
        checkpoint_interval=DEFAULT_CHECKPOINT_INTERVAL if checkpoint_interval is None else checkpoint_interval,
        checkpoint_dir=checkpoint_dir,
        checkpoint_step=resumed["step"] if resumed else None, checkpoint_path=resume_from if resumed else "",
        elastic=elastic, min_gpus=min_gpus, max_gpus=max_gpus, priority=priority,
        dataset=data, dataset_samples_per_epoch=samples_per_epoch, eval_every=eval_every, eval_batches=eval_batches,
        init_from=weights.relative if weights is not None else "",
        validation_samples=validation_samples, initial_weights=weights if weights is not None and not model_given
        else None,
    )


def _evaluation_problem(data, *, eval_every: int, eval_batches: int, global_batch: int, seq_len: int,
                        checked: bool) -> str | int | None:
    """Why the job cannot evaluate a validation loss every `eval_every` steps (a message), else the
    validation split's samples at seq_len (None when the dataset is refused otherwise): it needs a
    dataset with a validation split holding eval_batches global batches of samples."""
    if data is None:
        return (f"eval_every={eval_every} evaluates the loss on a dataset's validation split: give `dataset` "
                f"(synthetic tokens have none), or set eval_every to 0")
    if not data.validation_documents:
        return (f"dataset {data.name!r} has no validation split (validation_fraction {data.validation_fraction:g}): "
                f"prepare it with a --validation-fraction above 0, or set eval_every to 0")
    if not checked:
        return None
    try:
        samples = dataset_validation_samples(data, seq_len)
    except InvalidInput as exc:
        return exc.errors["eval_every"][0]
    need = eval_batches * global_batch
    if samples < need:
        most = samples // global_batch
        fix = (f"lower eval_batches (at most {most})" if most else
               "a smaller global_batch or seq_len (the split holds less than one global batch)")
        return (f"the validation split of dataset {data.name!r} holds {samples:,} samples of seq_len {seq_len} + 1 "
                f"tokens, fewer than eval_batches={eval_batches} x global_batch={global_batch} = {need:,}: {fix}")
    return samples


def _dataset_problem(config, dataset) -> str | None:
    """Why the model cannot train on the dataset (None: it can): token ids its embedding has no
    row for, or images it would need (datasets hold tokens for decoder-only models)."""
    if config.encoder is not None:
        return (f"{config.name} is multimodal; datasets feed decoder-only models (leave `dataset` empty for "
                f"synthetic data)")
    if dataset.vocab_size > config.llm.vocab:
        return (f"dataset {dataset.name!r} has a vocab of {dataset.vocab_size:,} tokens, more than the "
                f"{config.llm.vocab:,} of {config.name}: token ids past {config.llm.vocab - 1} have no embedding row")
    return None


def job_create(*, created_by=None, queued: bool = False, **fields) -> Job:
    """A new pending job, with either a layout or a GPU count (the layout is then picked,
    layout_for_gpus); job_check holds the rules (the layout is checked against the model
    there). Scheduling it onto GPUs is scheduling.job_start. Checkpoints: every
    `checkpoint_interval` steps (default DEFAULT_CHECKPOINT_INTERVAL, 0: none) into
    `checkpoint_dir` (default <DYNAPLANE_VAR_DIR>/checkpoints/<name>-<id>; on a real cluster
    it must be shared storage every node mounts at the same path). `resume_from`: a
    checkpoint folder the job starts from instead of a fresh model (resume.py); it is the
    job's latest checkpoint until the job writes its own. `init_from`: a Hugging Face model
    directory under the weights root whose weights its first start loads (without `model`, the
    job trains the model its config.json describes, stored as a model). `eval_every` (0: never):
    the validation loss over `eval_batches` global batches of its dataset's validation split.
    `queued`: the elastic scheduler starts it when its priority lets it (elastic_apply.py)."""
    row = job_check(**fields)
    row.pop("validation_samples")
    weights = row.pop("initial_weights")
    if weights is not None:  # no `model`: the one config.json describes, stored as a model the agents resolve
        row["model"] = store_initial_model(weights)
    with transaction.atomic():
        if Job.objects.filter(name=row["name"]).exists():  # (again, under the transaction)
            raise InvalidInput({"name": [f"a job named {row['name']!r} already exists"]})
        job = Job.objects.create(**row, created_by=created_by, queued=queued)
        if not job.checkpoint_dir:
            job.checkpoint_dir = os.path.join(settings.DYNAPLANE_CHECKPOINT_ROOT, f"{job.name}-{job.pk}")
            job.save(update_fields=["checkpoint_dir"])
        publish_job(job, "upsert")
    return job


def job_delete(*, job_id: int) -> None:
    """Delete a job that is not running; its GPUs (if any) become free."""
    with transaction.atomic():
        job = Job.objects.select_for_update().get(pk=job_id)
        if job.state not in DELETABLE_JOB_STATES:
            raise Conflict(
                f"job {job.name!r} is {job.state}; only jobs that are "
                f"{', '.join(sorted(s.value for s in DELETABLE_JOB_STATES))} can be deleted (stop it first)"
            )
        gpus_release(gpus=job.gpus.all())
        publish_job(job, "remove")
        job.delete()


def metrics_series_get(*, job: Job, name: str, rank: int | None = None, transition: Transition | None = None,
                       unit: str = "") -> MetricSeries:
    with transaction.atomic():
        series, _ = MetricSeries.objects.select_for_update().get_or_create(
            job=job, transition=transition, name=name, rank=rank, defaults={"unit": unit}
        )
    return series


def metrics_append(*, series_id: int, xs: Sequence[float], ys: Sequence[float]) -> int:
    """Append samples to a series, filling its last chunk before starting a new one.
    Returns the series' point count."""
    if len(xs) != len(ys):
        raise InvalidInput({"samples": [f"{len(xs)} x values but {len(ys)} y values"]})
    with transaction.atomic():
        series = MetricSeries.objects.select_for_update().get(pk=series_id)
        xs, ys = list(xs), list(ys)
        last = series.chunks.order_by("-first_point").first()
        while xs:
            if last is None or last.count >= CHUNK_POINTS:
                last = MetricChunk(series=series, first_point=series.points, count=0, x=b"", y=b"")
            room = CHUNK_POINTS - last.count
            take_x, take_y, xs, ys = xs[:room], ys[:room], xs[room:], ys[room:]
            last.x = pack(unpack(last.x) + take_x)
            last.y = pack(unpack(last.y) + take_y)
            last.count += len(take_x)
            series.points += len(take_x)
            last.save()
        series.save(update_fields=["points"])
    return series.points


def job_metrics_truncate(*, job: Job, after_step: int) -> int:
    """Cut the job-level series (x: the step) before their first point past `after_step`: a
    restore from the checkpoint at that step discarded what came after it. Steps append in
    order, so the cut falls in the last chunks: they are read from the end until one lies wholly
    at or before the step. Returns the points removed (over all series)."""
    removed = 0
    with transaction.atomic(savepoint=False):
        for series in MetricSeries.objects.select_for_update().filter(job=job, transition__isnull=True,
                                                                      rank__isnull=True):
            cut = None
            for chunk in MetricChunk.objects.filter(series=series).order_by("-first_point"):
                xs = unpack(chunk.x)
                past = [i for i, x in enumerate(xs) if x > after_step]
                if not past:
                    break
                cut = chunk.first_point + past[0]
            if cut is None:
                continue
            MetricChunk.objects.filter(series=series, first_point__gte=cut).exclude(
                first_point=cut // CHUNK_POINTS * CHUNK_POINTS).delete()
            head = MetricChunk.objects.filter(series=series, first_point=cut // CHUNK_POINTS * CHUNK_POINTS).first()
            if head is not None:
                keep = cut - head.first_point
                if keep == 0:
                    head.delete()
                else:
                    head.x, head.y = pack(unpack(head.x)[:keep]), pack(unpack(head.y)[:keep])
                    head.count = keep
                    head.save(update_fields=["x", "y", "count"])
            removed += series.points - cut
            series.points = cut
            series.save(update_fields=["points"])
    return removed


def job_metrics_extend(*, job: Job, rows: Sequence[tuple[float, Mapping[str, float]]],
                       units: Mapping[str, str]) -> None:
    """Append samples to the job-level series (no rank, no transition): for each row
    (x, {name: value}), (x, value) to series `name`, creating a series on its first sample.
    The path of every step report (one row) and of a batch of them (many rows)."""
    jobs_metrics_extend(items=[(job, rows)], units=units)


def jobs_metrics_extend(*, items: Sequence[tuple[Job, Sequence[tuple[float, Mapping[str, float]]]]],
                        units: Mapping[str, str]) -> None:
    """job_metrics_extend for several jobs at once (the report batches a worker applies
    together: controlplane/jobs/ingest.py), in a fixed handful of statements for all jobs,
    series and rows together (metrics_append takes four per series): the series locked in
    one query, their last chunks fetched in one (a series' last chunk starts at
    points // CHUNK_POINTS * CHUNK_POINTS, as appends fill chunks in order), one insert of the
    new chunks, one executemany each for the changed chunks and the series' counts."""
    columns: dict[tuple[int, str], tuple[list[float], list[float]]] = {}
    jobs = {}
    for job, rows in items:
        jobs[job.pk] = job
        for x, values in rows:
            for name, value in values.items():
                xs, ys = columns.setdefault((job.pk, name), ([], []))
                xs.append(float(x))
                ys.append(float(value))
    if not columns:
        return
    with transaction.atomic(savepoint=False):  # (a savepoint would cost two statements per report)
        series = {(s.job_id, s.name): s for s in MetricSeries.objects.select_for_update().filter(
            job_id__in=sorted({job_id for job_id, _ in columns}), transition__isnull=True, rank__isnull=True,
            name__in=sorted({name for _, name in columns})).order_by("pk")}
        for job_id, name in columns:
            if (job_id, name) not in series:
                series[job_id, name] = metrics_series_get(job=jobs[job_id], name=name, unit=units.get(name, ""))
        partial = [s for s in series.values() if s.points % CHUNK_POINTS and (s.job_id, s.name) in columns]
        # PostgreSQL appends to a chunk's arrays in place (bytea ||): only the new samples travel,
        # where reading the chunk and writing it whole moved up to 16 KB a series per report
        # (most of a report's cost at 200 jobs: benchmarks/cluster_scale.py). SQLite's || makes
        # text of blobs, so there the chunk is rewritten.
        in_place = connection.vendor == "postgresql"
        last = {}
        if partial:
            # (row values: one condition for all series, where an OR of Q objects per series cost
            # the ORM milliseconds of Python at a few hundred series)
            table = connection.ops.quote_name(MetricChunk._meta.db_table)
            fields = "id, series_id, first_point, count" + ("" if in_place else ", x, y")
            pairs = ", ".join(["(%s, %s)"] * len(partial))
            params = [v for s in partial for v in (s.pk, s.points // CHUNK_POINTS * CHUNK_POINTS)]
            last = {c.series_id: c for c in MetricChunk.objects.raw(
                f"SELECT {fields} FROM {table} WHERE (series_id, first_point) IN ({pairs})", params)}
        new, appended, counts = [], {}, []  # appended: chunk id -> (chunk, xs, ys) added to a stored chunk
        for key, (xs, ys) in columns.items():
            s = series[key]
            chunk = last.get(s.pk)
            done = 0
            while done < len(xs):
                if chunk is None or chunk.count >= CHUNK_POINTS:
                    chunk = MetricChunk(series=s, first_point=s.points + done, count=0, x=b"", y=b"")
                    new.append(chunk)
                take = min(CHUNK_POINTS - chunk.count, len(xs) - done)
                if chunk.pk is None:
                    chunk.x = pack(unpack(chunk.x) + xs[done:done + take])
                    chunk.y = pack(unpack(chunk.y) + ys[done:done + take])
                else:
                    _, added_x, added_y = appended.setdefault(chunk.pk, (chunk, [], []))
                    added_x += xs[done:done + take]
                    added_y += ys[done:done + take]
                chunk.count += take
                done += take
            counts.append((len(xs), s.pk))
            s.points += len(xs)
        if new:
            MetricChunk.objects.bulk_create(new)
        # Plain statements, not bulk_update: its CASE WHEN per row cost this path more Python
        # (~17 ms of a 90 ms report on the loaded CI machine) than the round trips it saves
        # (benchmarks/step_reports.py).
        with connection.cursor() as cursor:
            table = connection.ops.quote_name(MetricChunk._meta.db_table)
            if appended and in_place:
                cursor.executemany(f"UPDATE {table} SET x = x || %s, y = y || %s, count = count + %s WHERE id = %s",
                                   [(pack(xs), pack(ys), len(xs), c.pk) for c, xs, ys in appended.values()])
            elif appended:
                cursor.executemany(f"UPDATE {table} SET x = %s, y = %s, count = %s WHERE id = %s",
                                   [(pack(unpack(c.x) + xs), pack(unpack(c.y) + ys), c.count, c.pk)
                                    for c, xs, ys in appended.values()])
            table = connection.ops.quote_name(MetricSeries._meta.db_table)
            cursor.executemany(f"UPDATE {table} SET points = points + %s WHERE id = %s", counts)
