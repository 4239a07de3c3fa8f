"""The compare page: emulate several configurations and see them side by side.

The query string is the comparison: `model, gpu, gpus, batch, micro, seq, recompute`, one
`layout` per configuration and, once run, `runs` (the EmulationRun ids, comma-separated).
Opening the same URL shows the same runs again; the page follows them over
/ws/emulations/ and fetches /compare/data for figures when a run finishes.
"""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpResponse, JsonResponse
from django.shortcuts import render

from agents import protocol
from parallelism.layout.catalog import catalog_names
from controlplane.emulation.selectors import emulation_rows, emulation_snapshot
from frontend.compare_figures import compare_csv, compare_figures

DEFAULTS = {"model": "tiny-gpt", "gpu": "h100", "gpus": 4, "batch": 8, "micro": 1, "seq": 128, "recompute": "none"}
MAX_RUNS = 32


class BadQuery(ValueError):
    """A query parameter that cannot be read; the message names it."""


def parse_runs(value: str) -> list[int]:
    """'3,4' -> [3, 4]; a bad id raises BadQuery naming it."""
    ids = []
    for part in filter(None, (p.strip() for p in value.split(","))):
        if not part.isdigit() or int(part) < 1:
            raise BadQuery(f"runs: {part!r} is not a run id (positive integer)")
        ids.append(int(part))
    if len(ids) > MAX_RUNS:
        raise BadQuery(f"runs: at most {MAX_RUNS} runs, got {len(ids)}")
    return ids


def parse_settings(query) -> tuple[dict, list[str]]:
    """The form's settings from the query string, defaults for what is missing, and a
    message per parameter that had to be replaced by its default."""
    settings, problems = dict(DEFAULTS), []
    for key in ("gpus", "batch", "micro", "seq"):
        if key in query:
            value = query[key]
            if value.isdigit() and int(value) > 0:
                settings[key] = int(value)
            else:
                problems.append(f"{key}: {value!r} is not a positive integer; using {DEFAULTS[key]}")
    for key, choices in (("model", None), ("gpu", protocol.EMULATOR_DEVICES), ("recompute", protocol.RECOMPUTE_MODES)):
        if key in query:
            if choices is None or query[key] in choices:
                settings[key] = query[key]
            else:
                problems.append(f"{key}: {query[key]!r} is not one of {', '.join(choices)}; using {DEFAULTS[key]}")
    settings["layouts"] = [layout for layout in query.getlist("layout") if layout.strip()]
    return settings, problems


@login_required
def compare(request):
    settings, problems = parse_settings(request.GET)
    try:
        ids = parse_runs(request.GET.get("runs", ""))
    except BadQuery as exc:
        ids, problems = [], [*problems, str(exc)]
    snapshot = emulation_snapshot(ids)
    missing = [i for i in ids if i not in {run.id for run in snapshot.runs}]
    if missing:
        problems.append(f"runs: {', '.join(map(str, missing))} no longer exist")
    rows = emulation_rows(ids)
    if rows and not settings["layouts"]:
        settings["layouts"] = [row["layout"] for row in rows]
    models = catalog_names()
    if settings["model"] not in models:
        models = [settings["model"], *models]  # a config.json path given in the URL
    return render(request, "frontend/compare.html", {
        "settings": settings, "problems": problems, "models": models, "gpu_types": protocol.EMULATOR_DEVICES,
        "recompute_modes": protocol.RECOMPUTE_MODES,
        "initial": {"settings": settings, "snapshot": snapshot.model_dump(mode="json"),
                    "figures": compare_figures(rows) if rows else None},
    })


def _ids_or_400(request) -> list[int] | JsonResponse:
    try:
        ids = parse_runs(request.GET.get("runs", ""))
    except BadQuery as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    if not ids:
        return JsonResponse({"error": "runs: give at least one run id, e.g. ?runs=3,4"}, status=400)
    return ids


@login_required
def compare_data(request):
    """The runs' snapshot (with the stream's seq) and the figures built from them."""
    ids = _ids_or_400(request)
    if isinstance(ids, JsonResponse):
        return ids
    snapshot = emulation_snapshot(ids)
    return JsonResponse({"snapshot": snapshot.model_dump(mode="json"), "figures": compare_figures(emulation_rows(ids))})


@login_required
def compare_export(request):
    """The runs as CSV (one line per run, settings then figures), as a download."""
    ids = _ids_or_400(request)
    if isinstance(ids, JsonResponse):
        return ids
    response = HttpResponse(compare_csv(emulation_rows(ids)), content_type="text/csv; charset=utf-8")
    response["Content-Disposition"] = f'attachment; filename="dynaplane-compare-{"-".join(map(str, ids))}.csv"'
    return response


