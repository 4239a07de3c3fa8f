"""The elastic scheduler's page: what it would change now (with each change's reason and
predicted gain), the queued jobs it leaves waiting, every job's range, priority and policy
switch, its last sweep, and the cluster timeline of allocations. The page embeds
GET /api/elastic's answer and the timeline; elastic.js redraws both as jobs change."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, JsonResponse
from django.shortcuts import render
from django.utils import timezone

from controlplane.jobs.elastic_api import ElasticPlanSerializer
from controlplane.jobs.elastic_state import elastic_overview
from frontend.elastic_figures import allocation_figure
from frontend.elastic_history import allocation_history


def timeline_figure() -> dict:
    now = timezone.now()
    return allocation_figure(allocation_history(now), now)


@login_required
def elastic_page(request: HttpRequest):
    plan = ElasticPlanSerializer(elastic_overview()).data
    return render(request, "frontend/elastic.html", {"plan": plan, "timeline": timeline_figure()})


@login_required
def elastic_timeline(request: HttpRequest) -> JsonResponse:
    """The timeline, drawn now (the page fetches it when a job changes)."""
    return JsonResponse(timeline_figure())
