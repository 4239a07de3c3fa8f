"""Plotly figures as pure functions of plain data (the browser only calls Plotly.react)."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from frontend.figure_style import axis, byte_axis, legend_below, no_data
from frontend.formatting import binary_bytes, duration

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


LABEL_ROWS = 3  # band labels stack in at most this many rows above a chart; a label with no room is left out
LABEL_ROW_PX = 14
CHAR_PX = 6.6  # the width of a character of the 11 px label font, a little generous
CHART_PX = 600  # the plot width the server assumes; the page passes the real one (job-store.js)


def band_label_rows(bands: list[Mapping], plot_px: float = CHART_PX) -> list[int | None]:
    """The row (0: just above the plot) of each band's label such that no two labels of a
    row overlap, greedily left to right; None when all LABEL_ROWS rows are taken there. A
    label starts at its band's x0 and is len(text) * CHAR_PX + 8 px wide."""
    if not bands:
        return []
    lo, hi = min(b["x0"] for b in bands), max(b["x1"] for b in bands)
    per_px = (hi - lo or 1.0) / max(plot_px, 1.0)
    ends: list[float] = []  # the right edge of the last label of each row
    rows: list[int | None] = []
    for band in bands:
        width = (len(band_label(band)) * CHAR_PX + 8) * per_px
        row = next((r for r, end in enumerate(ends) if end <= band["x0"]), None)
        if row is None and len(ends) < LABEL_ROWS:
            row = len(ends)
            ends.append(0.0)
        if row is not None:
            ends[row] = band["x0"] + width
        rows.append(row)
    return rows


def band_label(band: Mapping) -> str:
    """The first band names its layout; later ones the switch that started them."""
    return band["layout"] if band["transition"] is None else f"#{band['transition']} → {band['layout']}"


def band_shapes(bands: Iterable[Mapping], plot_px: float = CHART_PX) -> tuple[list[dict], list[dict]]:
    """Plotly shapes and annotations for history bands: a shaded x range per layout, a
    dashed vertical line at each switch, and one label per band (rows from
    band_label_rows, so that labels never overlap)."""
    bands = list(bands)
    shapes, notes = [], []
    for i, (band, row) in enumerate(zip(bands, band_label_rows(bands, plot_px))):
        color = BAND_COLORS[i % len(BAND_COLORS)]
        shapes.append({"type": "rect", "xref": "x", "yref": "paper", "x0": band["x0"], "x1": band["x1"], "y0": 0,
                       "y1": 1, "fillcolor": color, "opacity": 0.08, "line": {"width": 0}, "layer": "below"})
        if band["transition"] is not None:
            shapes.append({"type": "line", "xref": "x", "yref": "paper", "x0": band["x0"], "x1": band["x0"],
                           "y0": 0, "y1": 1, "line": {"color": "#1d2330", "width": 1, "dash": "dash"},
                           "name": f"switch {band['transition']}"})
        if row is not None:
            notes.append({"xref": "x", "yref": "paper", "x": band["x0"], "y": 1, "xanchor": "left",
                          "yanchor": "bottom", "yshift": row * LABEL_ROW_PX, "text": band_label(band),
                          "showarrow": False, "font": {"size": 11, "color": color}})
    return shapes, notes


def top_margin(notes: list[dict]) -> int:
    """Room above the plot for the label rows in use."""
    rows = max((round(n.get("yshift", 0) / LABEL_ROW_PX) + 1 for n in notes), default=0)
    return 10 + LABEL_ROW_PX * rows


# The job's validation loss (the metric `validation_loss`, at its eval_every steps) is drawn on the
# loss chart as a second trace, one line across every resize (metric-charts.js: validationTrace).
VALIDATION = {"name": "validation", "mode": "lines+markers", "line": {"width": 1.5, "color": "#d62728"},
              "marker": {"size": 5, "color": "#d62728"}}
CHART_NAMES = tuple(METRIC_TITLES)  # the job page's charts, one per metric (validation_loss rides on loss's)


def validation_trace(series: Mapping) -> dict:
    """The validation loss as the loss chart's second trace (x: steps)."""
    return {"type": "scatter", **VALIDATION, "x": list(series["x"]), "y": list(series["y"]),
            "customdata": list(series["x"]), "hovertemplate": "step %{x}, validation: %{y:,.4~r}<extra></extra>"}


def metric_figure(name: str, series: Mapping | None, bands: Iterable[Mapping] = (),
                  validation: Mapping | None = None) -> dict:
    """One training metric over steps: one trace, the layout history as shaded bands with
    a marker at each switch; "no data yet" before the first step. The loss chart draws the
    validation loss (`validation`, when it has points) as a second trace, with a legend. The
    page redraws it from the live snapshot (metric-charts.js: metricFigure does the same)."""
    series = series or {"x": [], "y": []}
    shapes, notes = band_shapes(bands)
    figure = {
        "data": [{"type": "scatter", "mode": "lines", "name": name, "x": list(series["x"]), "y": list(series["y"]),
                  "line": {"width": 1.5}, "hovertemplate": "step %{x}: %{y:,.4~r}<extra></extra>"}],
        "layout": {"height": 220, "margin": {"l": 50, "r": 10, "t": top_margin(notes), "b": 36},
                   "xaxis": axis(title={"text": "step"}), "yaxis": axis(title={"text": METRIC_TITLES.get(name, name)}),
                   "shapes": shapes, "annotations": notes, "showlegend": False},
    }
    if name == "loss" and validation and validation["x"]:
        figure["data"].append(validation_trace(validation))
        figure["layout"].update(showlegend=True, legend=legend_below())
    return figure if series["x"] else no_data(figure)


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
    bar = byte_axis(top)
    figure = {
        "data": [{"type": "heatmap", "z": z, "x": list(range(world)), "y": list(range(world)),
                  "colorscale": "Blues", "reversescale": True, "zmin": 0, "zmax": top,  # more bytes: darker
                  "colorbar": {"title": {"text": "bytes"}, "tickmode": "array", "tickvals": bar["tickvals"],
                               "ticktext": bar["ticktext"]},
                  "customdata": [[binary_bytes(v) for v in row] for row in matrix],
                  "hoverongaps": False,
                  "hovertemplate": "rank %{y} → rank %{x}: %{customdata}<extra></extra>"}],
        "layout": {"height": 260 + 6 * min(world, 64), "margin": {"l": 60, "r": 10, "t": 10, "b": 50},
                   "xaxis": axis(title={"text": "destination rank"}, dtick=1 if world <= 32 else None, zeroline=False),
                   "yaxis": axis(title={"text": "source rank"}, dtick=1 if world <= 32 else None,
                                 autorange="reversed", zeroline=False)},
    }
    return figure if world and any(any(row) for row in matrix) else no_data(figure, "no bytes move between ranks")


def round_bytes_figure(round_bytes: list[int], round_seconds: list[float]) -> dict:
    """Bytes sent per round, hover with the estimated seconds."""
    rounds = list(range(1, len(round_bytes) + 1))
    figure = {
        "data": [{"type": "bar", "x": rounds, "y": list(round_bytes), "customdata": list(round_seconds),
                  "text": [f"{binary_bytes(b)}, ~{duration(t)}" for b, t in zip(round_bytes, round_seconds)],
                  "textposition": "none", "marker": {"color": "#2f6fd6"},
                  "hovertemplate": "round %{x}: %{text}<extra></extra>"}],
        "layout": {"height": 220, "margin": {"l": 60, "r": 10, "t": 10, "b": 40},
                   "xaxis": axis(title={"text": "round"}, dtick=1 if len(rounds) <= 30 else None),
                   "yaxis": byte_axis(max(round_bytes, default=0), title={"text": "bytes sent"})},
    }
    return figure if rounds else no_data(figure, "no rounds: nothing moves")


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
        # Lower ranks are drawn wider and under the higher ones: ranks with the same wave
        # (every data-parallel replica) show as nested stripes instead of one line.
        data.append({"type": "scatter", "mode": "lines", "name": f"rank {rank} predicted", "x": xs, "y": ys,
                     "legendgroup": f"rank {rank}", "opacity": 0.85,
                     "line": {"color": RANK_COLORS[rank % len(RANK_COLORS)], "width": wave_width(rank, world)},
                     "customdata": [binary_bytes(y) for y in ys],
                     "hovertemplate": f"rank {rank} predicted" + ": %{customdata}<extra></extra>"})
    for rank, wave in sorted(((int(r), w) for r, w in (measured_waves or {}).items())):
        if rank < world and wave:
            data.append({"type": "scatter", "mode": "lines+markers", "name": f"rank {rank} measured",
                         "x": xs[:len(wave)], "y": list(wave[:len(xs)]), "legendgroup": f"rank {rank}",
                         "line": {"color": RANK_COLORS[rank % len(RANK_COLORS)], "dash": "dot", "width": 2},
                         "marker": {"size": 6}, "customdata": [binary_bytes(y) for y in wave[:len(xs)]],
                         "hovertemplate": f"rank {rank} measured" + ": %{customdata}<extra></extra>"})
    for rank, peak in sorted((measured or {}).items()):
        if rank < world:
            predicted = [wave_peak[k][rank] for k in range(rounds)] or [0]
            k = max(range(len(predicted)), key=predicted.__getitem__)
            data.append({"type": "scatter", "mode": "markers", "name": f"rank {rank} measured peak",
                         "x": [k + 0.5], "y": [peak], "legendgroup": f"rank {rank}",
                         "marker": {"symbol": "diamond", "size": 11, "color": "#c0392b"},
                         "customdata": [binary_bytes(peak)],
                         "hovertemplate": f"rank {rank} measured peak" + ": %{customdata}<extra></extra>"})
    shapes = []
    highest = max((max(row) for row in wave_peak if row), default=0)
    if capacity_bytes and highest * 4 >= capacity_bytes:
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": capacity_bytes,
                       "y1": capacity_bytes, "line": {"dash": "dash", "color": "#c0392b", "width": 1}})
    drawn = [y for trace in data for y in trace["y"]] + ([capacity_bytes] if shapes else [])
    figure = {
        "data": data,
        "layout": {"height": 320, "margin": {"l": 70, "r": 10, "t": 10, "b": 40},
                   "hovermode": "x unified",  # every rank's bytes at the round under the pointer
                   "xaxis": axis(title={"text": "round (0: before; k.5: peak within round k+1)"}),
                   "yaxis": byte_axis(max(drawn, default=0), title={"text": "state bytes"}, rangemode="tozero"),
                   "shapes": shapes, "legend": legend_below()},
    }
    return figure if world else no_data(figure)


def wave_width(rank: int, world: int) -> float:
    """Line width of a rank's predicted wave: rank 0 widest, the last rank 1.5 px."""
    return 1.5 + 1.5 * (world - 1 - rank) / max(world - 1, 1) if world > 1 else 2.0
