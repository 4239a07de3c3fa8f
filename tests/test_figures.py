"""Figures are pure functions of data."""
from __future__ import annotations

from frontend.figures import GPU_STATES, gpu_state_figure


def test_gpu_state_figure_counts_per_node_and_state() -> None:
    gpus = [
        {"node": "node-1", "state": "free"}, {"node": "node-1", "state": "lost"},
        {"node": "node-2", "state": "allocated"}, {"node": "node-2", "state": "allocated"},
        {"node": "ghost", "state": "free"},
    ]
    figure = gpu_state_figure(["node-1", "node-2"], gpus)
    assert [t["name"] for t in figure["data"]] == list(GPU_STATES)
    by_state = {t["name"]: t["y"] for t in figure["data"]}
    assert by_state == {"free": [1, 0], "allocated": [0, 2], "draining": [0, 0], "lost": [1, 0]}
    assert all(t["x"] == ["node-1", "node-2"] for t in figure["data"])
    assert figure["layout"]["barmode"] == "stack"


def test_empty_cluster_still_has_every_trace() -> None:
    figure = gpu_state_figure([], [])
    assert [t["y"] for t in figure["data"]] == [[], [], [], []]
