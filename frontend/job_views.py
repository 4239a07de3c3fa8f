"""Job pages: the jobs list, a job's live page with the resize flow, a transition's detail,
and the small JSON pieces those pages fetch (figures built here, by frontend.figures)."""
from __future__ import annotations

from datetime import datetime

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, JsonResponse
from django.shortcuts import get_object_or_404, render

from agents.protocol import EMULATOR_DEVICES
from controlplane.cluster.selectors import cluster_snapshot
from controlplane.common.errors import InvalidInput
from controlplane.common.model_store import model_list
from controlplane.datasets.selectors import dataset_list
from controlplane.exports.selectors import export_list, export_view
from controlplane.jobs.lifecycle import (DELETABLE_JOB_STATES, LIVE_JOB_STATES, RESIZABLE_JOB_STATES,
                                        STARTABLE_JOB_STATES, STOPPABLE_JOB_STATES, JobState, TransitionKind)
from controlplane.jobs.metric_codec import unpack
from controlplane.jobs.models import DEFAULT_CHECKPOINT_INTERVAL, Job, MetricSeries, Transition
from controlplane.jobs.resize_preview import gpu_capacity_bytes, job_plan, transition_plan
from controlplane.jobs.selectors import job_live_snapshot, job_log_view
from frontend import formatting
from frontend.elastic_text import range_text
from frontend.jobs_query import SORT_COLUMNS, STATE_FILTERS, parse_jobs_query
from frontend.figures import (
    CHART_NAMES,
    history_bands,
    memory_wave_figure,
    metric_figure,
    plan_heatmap_figure,
    round_bytes_figure,
    step_time_around,
)
from frontend.layout_view import module_legend, rank_coordinates

def emulator_device(gpu_models: list[str]) -> str:
    """The emulator's device for the cluster's GPUs ("NVIDIA H100 80GB HBM3" -> h100);
    cpu for virtual GPUs or models it does not know."""
    for name in gpu_models:
        for device in EMULATOR_DEVICES:
            if device != "cpu" and device in name.lower():
                return device
    return "cpu"


JOB_FIELDS = ("id", "name", "model", "layout", "world_size", "state", "global_batch", "micro_batch", "seq_len",
              "max_steps", "error", "placement", "elastic", "min_gpus", "max_gpus", "priority", "queued")


# The elastic card's form (PATCH /api/jobs/{id}/elastic): field, label, hint.
ELASTIC_FIELDS = (("min_gpus", "Fewest GPUs", "empty: its size"), ("max_gpus", "Most GPUs", "empty: its size"),
                  ("priority", "Priority", "higher gets GPUs first"))


# The states each of the job page's actions applies in (controlplane/jobs/lifecycle.py): its
# buttons and resize controls are enabled from these, not from a copy of the rules in JS.
ACTION_STATES = {action: sorted(s.value for s in states) for action, states in (
    ("start", STARTABLE_JOB_STATES), ("stop", STOPPABLE_JOB_STATES), ("delete", DELETABLE_JOB_STATES),
    ("resize", RESIZABLE_JOB_STATES))}
# Proposals and plan previews (read-only) also while the job starts: it is about to run.
ACTION_STATES["preview"] = sorted({*ACTION_STATES["resize"], JobState.STARTING.value})


def job_data(job: Job) -> dict:
    """The job's row as its page draws it. Ranks only while the job is live: a stopped or
    failed job keeps its last placement in the row, but its GPUs are free (or another's)."""
    data = {name: getattr(job, name) for name in JOB_FIELDS}
    data["step"] = job.step
    data["checkpoint_step"] = job.checkpoint_step
    data["ranks"] = rank_coordinates(job.layout, job.placement) if job.state in LIVE_JOB_STATES else []
    data["modules"] = module_legend(job.layout)  # heterogeneous layouts: each module's layout and ranks
    data["dataset"] = {"id": job.dataset_id, "name": job.dataset.name} if job.dataset_id is not None else None
    data["samples_per_epoch"] = job.dataset_samples_per_epoch  # the page counts data progress (job-store.js)
    data["eval_every"], data["eval_batches"], data["init_from"] = job.eval_every, job.eval_batches, job.init_from
    data["checkpoint_interval"] = job.checkpoint_interval  # (the export card says when a first checkpoint comes)
    return data


def plan_figures(plan: dict, *, measured: dict[int, int] | None = None,
                 measured_waves: dict[str, list[int]] | None = None) -> dict:
    """The plan's three figures and its headline numbers, as the pages draw them."""
    return {
        "heatmap": plan_heatmap_figure(plan["matrix"]),
        "rounds": round_bytes_figure(plan["round_bytes"], plan["round_seconds"]),
        "wave": memory_wave_figure(plan["wave_after"], plan["wave_peak"], capacity_bytes=gpu_capacity_bytes(),
                                   measured=measured, measured_waves=measured_waves),
        "summary": {key: plan["summary"].get(key) for key in (
            "src", "dst", "world_src", "world_dst", "network_bytes", "min_network_bytes", "local_bytes", "rounds",
            "transfers", "predicted_peak_bytes", "peak_staging_bytes", "estimated_seconds", "fingerprint")},
    }


def summary_rows(summary: dict) -> list[tuple[str, str]]:
    """The plan summary as (label, text) rows, through the one formatter: bytes in binary
    units with the exact count beside them, seconds as a duration."""
    rows = []
    for key, value in summary.items():
        if value is None:
            text = formatting.DASH
        elif key.endswith("bytes"):
            text = formatting.binary_bytes(value) + (f" ({formatting.integer(value)} B)" if value >= 1024 else "")
        elif key.endswith("seconds"):
            text = formatting.duration(value)
        else:
            text = str(value)
        rows.append((key.replace("_", " "), text))
    return rows


def last_losses(job_ids: list[int]) -> dict[int, float]:
    """Each job's latest reported loss (jobs without one are left out): one read of the
    last chunk of each loss series."""
    out = {}
    for series in MetricSeries.objects.filter(job_id__in=job_ids, transition=None, rank=None, name="loss"):
        chunk = series.chunks.order_by("-first_point").first()
        values = unpack(chunk.y) if chunk is not None else []
        if values:
            out[series.job_id] = values[-1]
    return out


def free_name(taken: set[str], stem: str = "job") -> str:
    """The first of job-1, job-2, ... no job has: the New job form's suggested name."""
    n = 1
    while f"{stem}-{n}" in taken:
        n += 1
    return f"{stem}-{n}"


def new_job_defaults(total_gpus: int) -> dict:
    """The New job form's starting values: the API's defaults (JobCreateSerializer), on the
    smallest model, on at most two GPUs."""
    return {"model": "tiny-gpt", "gpus": max(1, min(2, total_gpus)), "global_batch": 8, "micro_batch": 1,
            "seq_len": 128, "checkpoint_interval": DEFAULT_CHECKPOINT_INTERVAL, "priority": 0, "eval_every": 0,
            "eval_batches": 4}


def aria_sort(view: dict, column: str) -> str:
    """A column header's aria-sort for the view."""
    if view["sort"] != column:
        return "none"
    return "ascending" if view["dir"] == "asc" else "descending"


@login_required
def jobs_list(request: HttpRequest):
    """The jobs, kept live by jobs.js: state, layout and GPUs from the cluster stream, step
    and loss from each live job's stream; sorted, filtered and searched as the address says
    (jobs_query.py: a bad value is a 400 naming it, and that part keeps its default);
    the New job form (job-form.js) above them."""
    jobs = list(Job.objects.prefetch_related("transitions").order_by("-created_at", "-id"))
    losses = last_losses([job.pk for job in jobs])
    for job in jobs:
        job.last_loss = losses.get(job.pk)
        job.range_text = range_text(job.min_gpus, job.max_gpus, job.world_size)
    total_gpus = len(cluster_snapshot().gpus)
    models = model_list()
    datasets = [{"id": d.pk, "name": d.name, "tokens": d.tokens, "documents": d.documents, "vocab_size": d.vocab_size,
                 "tokenizer": d.tokenizer} for d in dataset_list()]
    view, problems = parse_jobs_query(request.GET)
    columns = [(key, label, aria_sort(view, key)) for key, label in zip(SORT_COLUMNS, (
        "Name", "Model", "Layout", "GPUs", "State", "Step", "Loss", "Switches", "Elastic range", "Priority",
        "Created"))]
    return render(request, "frontend/jobs.html", {
        "view": view, "problems": problems, "columns": columns, "state_filters": STATE_FILTERS,
        "sort_defaults": SORT_COLUMNS,
        "jobs": jobs, "live_states": sorted(s.value for s in LIVE_JOB_STATES),
        "catalog_models": [m for m in models if m["source"] == "catalog"],
        "stored_models": [m for m in models if m["source"] == "stored" and not m["error"]], "datasets": datasets,
        "defaults": new_job_defaults(total_gpus), "suggested_name": free_name({job.name for job in jobs}),
        "total_gpus": total_gpus, "deleted": request.GET.get("deleted", "")[:63],
    }, status=400 if problems else 200)


@login_required
def job_detail(request: HttpRequest, job_id: int):
    job = get_object_or_404(Job.objects.select_related("dataset"), pk=job_id)
    live = job_live_snapshot(job_id=job.pk).model_dump(mode="json")
    steps = live["metrics"].get("loss", {}).get("x") or [0]
    bands = history_bands(job.layout, live["transitions"], steps[-1])
    figures = {name: metric_figure(name, live["metrics"].get(name), bands,
                                   validation=live["metrics"].get("validation_loss"))
               for name in CHART_NAMES}
    cluster = cluster_snapshot().model_dump(mode="json")
    exports = [export_view(row).model_dump(mode="json") for row in export_list(job_id=job.pk)[:50]]
    return render(request, "frontend/job.html", {
        "job": job, "job_data": job_data(job), "live": live, "figures": figures, "cluster": cluster,
        "exports": exports,
        "action_states": ACTION_STATES, "job_log": job_log_view(job_id=job.pk).model_dump(mode="json"),
        "total_gpus": len(cluster["gpus"]), "emulator_devices": EMULATOR_DEVICES, "elastic_fields": ELASTIC_FIELDS,
        "emulator_default": emulator_device([g["model_name"] for g in cluster["gpus"]]),
    })


@login_required
def job_state(request: HttpRequest, job_id: int) -> JsonResponse:
    """The job's row and its ranks' coordinates (the page redraws the layout after a switch)."""
    return JsonResponse(job_data(get_object_or_404(Job.objects.select_related("dataset"), pk=job_id)))


@login_required
def job_plan_figures(request: HttpRequest, job_id: int) -> JsonResponse:
    """The plan preview of a switch to ?layout=, drawn."""
    job = get_object_or_404(Job, pk=job_id)
    layout = request.GET.get("layout", "").strip()
    if not layout:
        return JsonResponse({"error": "give the destination layout, e.g. ?layout=dp=4"}, status=400)
    try:
        plan = job_plan(job=job, layout=layout)
    except InvalidInput as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    return JsonResponse(plan_figures(plan))


def history_offsets(history: list[dict]) -> list[dict]:
    """The switch's states, each with `since`: seconds after the first state (None where a
    time cannot be read)."""
    def parse(at):
        try:
            return datetime.fromisoformat(at)
        except (TypeError, ValueError):
            return None

    first = parse(history[0].get("at")) if history else None
    rows = []
    for i, h in enumerate(history):
        at = parse(h.get("at"))
        since = (at - first).total_seconds() if i and at is not None and first is not None else None
        rows.append({**h, "since": since})
    return rows


@login_required
def transition_detail(request: HttpRequest, transition_id: int):
    transition = get_object_or_404(Transition.objects.select_related("job"), pk=transition_id)
    restore = transition.kind == TransitionKind.RESTORE  # loaded from a checkpoint: no routing plan ran
    plan = None if restore else transition_plan(transition=transition)
    waves = (transition.progress or {}).get("waves") or None
    # Transitions from before the measured waves were reported show rank 0's peak only.
    measured = {0: transition.peak_bytes} if transition.peak_bytes and not waves else None
    live = job_live_snapshot(job_id=transition.job_id).model_dump(mode="json")
    before, after = step_time_around(live["metrics"].get("step_seconds"), transition.step)
    timings = [(label, getattr(transition, f"{name}_seconds")) for label, name in (
        ("Preparation (hidden behind training)", "prepare"), ("Pause (training stopped)", "pause"),
        ("Transfer", "transfer"), ("Verification", "verify"))]
    figures = plan_figures(plan, measured=measured, measured_waves=waves) if plan is not None else None
    tensors = (transition.verification or {}).get("tensors") or []
    tensors = sorted(tensors, key=lambda row: row["match"])  # a mismatch first
    return render(request, "frontend/transition.html", {
        "transition": transition, "figures": figures, "restore": restore,
        "survivors": (transition.verification or {}).get("survivors") if restore else None,
        "summary_rows": summary_rows(figures["summary"]) if figures else [],
        "timings": timings,
        "step_before": before, "step_after": after, "history": history_offsets(transition.history),
        "verification": transition.verification, "tensors": tensors,
        "failed_tensors": sum(1 for row in tensors if not row["match"]), "progress": transition.progress,
    })


@login_required
def transition_wave(request: HttpRequest, transition_id: int) -> JsonResponse:
    """The transition's memory-wave figure, predicted with the measured waves so far, and
    its progress (the job page redraws it as `transferring` reports arrive)."""
    transition = get_object_or_404(Transition.objects.select_related("job"), pk=transition_id)
    if transition.kind == TransitionKind.RESTORE:
        return JsonResponse({"error": f"transition {transition.pk} is a restore: no routing plan ran"}, status=400)
    plan = transition_plan(transition=transition)
    progress = transition.progress or {}
    return JsonResponse({"progress": progress, "wave": memory_wave_figure(
        plan["wave_after"], plan["wave_peak"], capacity_bytes=gpu_capacity_bytes(),
        measured_waves=progress.get("waves"))})
