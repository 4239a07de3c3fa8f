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


# --- job pages ------------------------------------------------------------------------------

METRIC_TITLES = {"loss": "Loss", "step_seconds": "Step time (s)", "tokens_per_second": "Tokens/s"}
BAND_COLORS = ("#2f6fd6", "#d79a1c")  # alternate per layout
TERMINAL_TRANSITIONS = ("committed", "aborted", "rolled_back", "failed")


def history_bands(source_layout: str | None, transitions: Iterable[Mapping], last_step: float | None) -> list[dict]:
    """The steps each layout ran, from the committed transitions (oldest first): a band
    {x0, x1, layout, transition} per layout. `transition` is the id of the switch that
    started the band (None for the first). A committed transition's `step` is the last
    step of its source layout. Example: transitions committed at steps 10 and 25, last step
    40 -> [0, 10] dp=2, [10, 25] dp=4, [25, 40] dp=3."""
    committed = [t for t in transitions if t["state"] == "committed" and t.get("step") is not None]
    first = committed[0]["source_layout"] if committed else source_layout
    if first is None:
        return []
    bands, x0, layout, started_by = [], 0.0, first, None
    for t in committed:
        bands.append({"x0": x0, "x1": float(t["step"]), "layout": layout, "transition": started_by})
        x0, layout, started_by = float(t["step"]), t["destination_layout"], t["id"]
    end = max(float(last_step or 0.0), x0)
    bands.append({"x0": x0, "x1": end, "layout": layout, "transition": started_by})
    return bands


def band_shapes(bands: Iterable[Mapping]) -> tuple[list[dict], list[dict]]:
    """Plotly shapes (shaded x ranges) and annotations (the layout) for history bands."""
    shapes, notes = [], []
    for i, band in enumerate(bands):
        color = BAND_COLORS[i % len(BAND_COLORS)]
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": band["x0"], "x1": band["x1"], "y0": 0,
                       "y1": 1, "fillcolor": color, "opacity": 0.08, "line": {"width": 0}, "layer": "below"})
        notes.append({"xref": "x", "yref": "paper", "x": band["x0"], "y": 1, "xanchor": "left", "yanchor": "bottom",
                      "text": band["layout"], "showarrow": False, "font": {"size": 11, "color": color}})
    return shapes, notes


def metric_figure(name: str, series: Mapping | None, bands: Iterable[Mapping] = ()) -> dict:
    """One training metric over steps: one trace (the page extends it in place), with the
    layout history as shaded bands when given."""
    series = series or {"x": [], "y": []}
    shapes, notes = band_shapes(bands)
    return {
        "data": [{"type": "scatter", "mode": "lines", "name": name, "x": list(series["x"]), "y": list(series["y"]),
                  "line": {"width": 1.5}, "hovertemplate": "step %{x}: %{y:.4g}<extra></extra>"}],
        "layout": {"height": 220, "margin": {"l": 50, "r": 10, "t": 24, "b": 36},
                   "xaxis": {"title": {"text": "step"}}, "yaxis": {"title": {"text": METRIC_TITLES.get(name, name)}},
                   "shapes": shapes, "annotations": notes, "showlegend": False},
    }


def step_time_around(series: Mapping | None, step: int | None, count: int = 5) -> tuple[float | None, float | None]:
    """Median step time of the `count` steps up to `step` and of the `count` steps after
    the first step that followed it (that one carries the pause)."""
    if not series or step is None:
        return None, None
    points = sorted(zip(series["x"], series["y"]))
    before = [y for x, y in points if x <= step][-count:]
    after = [y for x, y in points if x > step][1:count + 1]

    def median(values: list[float]) -> float | None:
        if not values:
            return None
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    return median(before), median(after)


def plan_heatmap_figure(matrix: list[list[int]] | None) -> dict:
    """Bytes from each source rank (row) to each destination rank (column); empty cells
    (no bytes) left blank so that the few routes stand out."""
    if matrix is None:
        return {"data": [], "layout": {"height": 120, "annotations": [{"text": "too many ranks to draw",
                                                                          "showarrow": False}]}}
    world = len(matrix)
    z = [[v if v else None for v in row] for row in matrix]
    top = max((v for row in matrix for v in row), default=0) or 1
    return {
        "data": [{"type": "heatmap", "z": z, "x": list(range(world)), "y": list(range(world)),
                  "colorscale": "Blues", "reversescale": True, "zmin": 0, "zmax": top,  # more bytes: darker
                  "colorbar": {"title": {"text": "bytes"}},
                  "hoverongaps": False,
                  "hovertemplate": "rank %{y} -> rank %{x}: %{z:,} B<extra></extra>"}],
        "layout": {"height": 260 + 6 * min(world, 64), "margin": {"l": 60, "r": 10, "t": 10, "b": 50},
                   "xaxis": {"title": {"text": "destination rank"}, "dtick": 1 if world <= 32 else None,
                             "zeroline": False},
                   "yaxis": {"title": {"text": "source rank"}, "dtick": 1 if world <= 32 else None,
                             "autorange": "reversed", "zeroline": False}},
    }


def round_bytes_figure(round_bytes: list[int], round_seconds: list[float]) -> dict:
    """Bytes sent per round, hover with the estimated seconds."""
    rounds = list(range(1, len(round_bytes) + 1))
    return {
        "data": [{"type": "bar", "x": rounds, "y": list(round_bytes), "customdata": list(round_seconds),
                  "marker": {"color": "#2f6fd6"},
                  "hovertemplate": "round %{x}: %{y:,} B, ~%{customdata:.3g} s<extra></extra>"}],
        "layout": {"height": 220, "margin": {"l": 60, "r": 10, "t": 10, "b": 40},
                   "xaxis": {"title": {"text": "round"}, "dtick": 1 if len(rounds) <= 30 else None},
                   "yaxis": {"title": {"text": "bytes sent"}}},
    }


RANK_COLORS = ("#2f6fd6", "#d79a1c", "#2e9d5b", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d35400")


def wave_xs(rounds: int) -> list[float]:
    """The x of each point of a wave: 0 before the first round, k + 0.5 the peak within
    round k + 1, k + 1 after it."""
    xs = [0.0]
    for k in range(rounds):
        xs += [k + 0.5, k + 1.0]
    return xs


def memory_wave_figure(wave_after: list[list[int]], wave_peak: list[list[int]], *,
                       capacity_bytes: int | None = None, measured: Mapping[int, int] | None = None,
                       measured_waves: Mapping[str | int, list[int]] | None = None) -> dict:
    """Predicted state bytes per rank through the switch (x: wave_xs): one solid line per
    rank; `measured_waves` ({rank: [start, peak 1, after 1, ...]}, as far as the transfer
    got) drawn over them as dotted lines with markers in the rank's colour; `measured`
    ({rank: peak bytes}, older transitions that reported only rank 0's peak) as a diamond
    at the highest predicted point's x; the GPU capacity as a dashed line when the peak
    reaches a quarter of it (else the waves would be flat at the bottom)."""
    rounds = len(wave_peak)
    world = len(wave_after[0]) if wave_after else 0
    xs = wave_xs(rounds)
    data = []
    for rank in range(world):
        ys = [wave_after[0][rank]]
        for k in range(rounds):
            ys += [wave_peak[k][rank], wave_after[k + 1][rank]]
        data.append({"type": "scatter", "mode": "lines", "name": f"rank {rank} predicted", "x": xs, "y": ys,
                     "legendgroup": f"rank {rank}", "line": {"color": RANK_COLORS[rank % len(RANK_COLORS)]},
                     "hovertemplate": f"rank {rank} predicted" + " @ %{x}: %{y:,} B<extra></extra>"})
    for rank, wave in sorted(((int(r), w) for r, w in (measured_waves or {}).items())):
        if rank < world and wave:
            data.append({"type": "scatter", "mode": "lines+markers", "name": f"rank {rank} measured",
                         "x": xs[:len(wave)], "y": list(wave[:len(xs)]), "legendgroup": f"rank {rank}",
                         "line": {"color": RANK_COLORS[rank % len(RANK_COLORS)], "dash": "dot", "width": 2},
                         "marker": {"size": 6},
                         "hovertemplate": f"rank {rank} measured" + " @ %{x}: %{y:,} B<extra></extra>"})
    for rank, peak in sorted((measured or {}).items()):
        if rank < world:
            predicted = [wave_peak[k][rank] for k in range(rounds)] or [0]
            k = max(range(len(predicted)), key=predicted.__getitem__)
            data.append({"type": "scatter", "mode": "markers", "name": f"rank {rank} measured peak",
                         "x": [k + 0.5], "y": [peak], "legendgroup": f"rank {rank}",
                         "marker": {"symbol": "diamond", "size": 11, "color": "#c0392b"},
                         "hovertemplate": f"rank {rank} measured peak" + ": %{y:,} B<extra></extra>"})
    shapes = []
    highest = max((max(row) for row in wave_peak if row), default=0)
    if capacity_bytes and highest * 4 >= capacity_bytes:
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": capacity_bytes,
                       "y1": capacity_bytes, "line": {"dash": "dash", "color": "#c0392b", "width": 1}})
    return {
        "data": data,
        "layout": {"height": 320, "margin": {"l": 70, "r": 10, "t": 10, "b": 40},
                   "xaxis": {"title": {"text": "round (0: before; k.5: peak within round k+1)"}},
                   "yaxis": {"title": {"text": "state bytes"}, "rangemode": "tozero"}, "shapes": shapes,
                   "legend": {"orientation": "h", "y": -0.35, "yanchor": "top"}},
    }
