"""Plotly figures as pure functions of plain data (the browser only calls Plotly.react)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

GPU_STATES = ("free", "allocated", "draining", "lost")
STATE_COLORS = {"free": "#2e9d5b", "allocated": "#2f6fd6", "draining": "#d79a1c", "lost": "#c0392b"}


def gpu_state_counts(nodes: Iterable[str], gpus: Iterable[Mapping]) -> dict[str, list[int]]:
    """Per state, the number of GPUs of each node (in the given node order)."""
    order = list(nodes)
    position = {name: i for i, name in enumerate(order)}
    counts = {state: [0] * len(order) for state in GPU_STATES}
    for gpu in gpus:
        if gpu["node"] in position:
            counts[gpu["state"]][position[gpu["node"]]] += 1
    return counts


def gpu_state_figure(nodes: Iterable[str], gpus: Iterable[Mapping]) -> dict:
    """Stacked bars: GPUs per node, split by state. One trace per state, always present
    (and in GPU_STATES order) so the page can update it in place."""
    order = list(nodes)
    counts = gpu_state_counts(order, gpus)
    return {
        "data": [
            {"type": "bar", "name": state, "x": order, "y": counts[state], "marker": {"color": STATE_COLORS[state]},
             "hovertemplate": "%{x}: %{y} " + state + "<extra></extra>"}
            for state in GPU_STATES
        ],
        "layout": {
            "barmode": "stack",
            "height": 240,
            "margin": {"l": 40, "r": 10, "t": 10, "b": 40},
            "yaxis": {"title": {"text": "GPUs"}, "dtick": 1, "rangemode": "tozero"},
            "legend": {"orientation": "h", "y": -0.25, "traceorder": "normal"},
        },
    }
