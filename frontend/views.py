"""Pages. Each page embeds a snapshot (with its seq) and the figures built from it;
its script applies live events on top."""
from __future__ import annotations

from typing import get_args

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import render

from controlplane.cluster.events import GpuStateName, NodeStateName
from controlplane.cluster.page_snapshot import cluster_rows
from controlplane.jobs.lifecycle import JobState
from frontend.cluster_compact import compact_gpus

STATES = {"node": list(get_args(NodeStateName)), "gpu": list(get_args(GpuStateName)),
          "job": [s.value for s in JobState]}


def _cluster_page_snapshot() -> dict:
    seq, nodes, gpus, jobs = cluster_rows()
    return {"seq": seq, "nodes": nodes, "gpus": compact_gpus(gpus), "jobs": jobs}


@login_required
def dashboard(request):
    """The cluster page: summary, the GPU grid (a canvas), the node list, the jobs."""
    return render(request, "frontend/dashboard.html",
                  {"snapshot": _cluster_page_snapshot(), "states": STATES})


@login_required
def dashboard_snapshot(request):
    """The cluster page's snapshot again (compact GPUs), for a page that missed events."""
    return JsonResponse(_cluster_page_snapshot())
