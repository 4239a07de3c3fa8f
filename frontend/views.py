"""Pages. Each page embeds a snapshot (with its seq) and the figures built from it;
its script applies live events on top."""
from __future__ import annotations

from django.contrib.auth.decorators import login_required
from django.shortcuts import render

from controlplane.cluster.selectors import cluster_snapshot
from frontend.figures import GPU_STATES, STATE_COLORS, gpu_state_figure


@login_required
def dashboard(request):
    snapshot = cluster_snapshot()
    data = snapshot.model_dump(mode="json")
    figure = gpu_state_figure([n["name"] for n in data["nodes"]], data["gpus"])
    return render(
        request,
        "frontend/dashboard.html",
        {"snapshot": data, "gpu_figure": figure, "gpu_states": GPU_STATES, "state_colors": STATE_COLORS},
    )
