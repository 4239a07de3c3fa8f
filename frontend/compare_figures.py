"""Figures, the settings table and the CSV of the compare page, as pure functions of runs.

A run is a plain dict: the settings (model, layout, gpus, gpu_type, global_batch,
micro_batch, seq_len, recompute), its state, and `result` (the `dynaplane emulate --json`
object, contract 4) once done. Runs without a result (queued, running, failed) keep their
place on the x axis with no bars, so configurations never shift while others finish.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence

from frontend.figure_style import axis, legend_below, no_data
from frontend.formatting import binary_bytes, count, duration, percent, sig

BREAKDOWN = ("compute", "tp_comm", "dp_comm", "pp_comm", "bubble")
BREAKDOWN_LABELS = {"compute": "compute", "tp_comm": "TP comm", "dp_comm": "DP comm", "pp_comm": "PP comm",
                    "bubble": "pipeline bubble"}
BREAKDOWN_COLORS = {"compute": "#2f6fd6", "tp_comm": "#d79a1c", "dp_comm": "#2e9d5b", "pp_comm": "#8e44ad",
                    "bubble": "#9aa3b5"}
MEMORY_PARTS = ("params", "grads", "optimizer", "activations")
MEMORY_COLORS = {"params": "#2f6fd6", "grads": "#5fa8e8", "optimizer": "#2e9d5b", "activations": "#d79a1c"}
SETTINGS = ("model", "layout", "gpus", "gpu_type", "global_batch", "micro_batch", "seq_len", "recompute")
SETTING_LABELS = {"model": "model", "layout": "layout", "gpus": "GPUs", "gpu_type": "GPU type",
                  "global_batch": "global batch", "micro_batch": "micro-batch", "seq_len": "sequence",
                  "recompute": "recompute"}
CSV_COLUMNS = ("id", *SETTINGS, "state", "step_seconds", *BREAKDOWN, "tokens_per_second", "model_tflops_per_gpu",
               "hardware_tflops_per_gpu", "mfu", "peak_bytes", "capacity_bytes", "fits", "error")
GIB = 2**30
OFF_SCALE = 40  # capacity more than this many times the highest peak: written, not drawn


def config_labels(runs: Sequence[Mapping]) -> list[str]:
    """One unique x label per run: its position and layout, e.g. "#2 tp=2,dp=2"."""
    return [f"#{i + 1} {run['layout']}" for i, run in enumerate(runs)]


def _result(run: Mapping) -> Mapping | None:
    result = run.get("result")
    return result if run.get("state") == "done" and result else None


def step_breakdown_figure(runs: Sequence[Mapping]) -> dict:
    """Stacked bars: each configuration's step time (ms) split into compute, TP/DP/PP
    communication and the pipeline bubble; one trace per part, always all five."""
    labels = config_labels(runs)
    results = [_result(run) for run in runs]
    data = []
    for part in BREAKDOWN:
        y = [r["breakdown"][part] * 1e3 if r else None for r in results]
        data.append({"type": "bar", "name": BREAKDOWN_LABELS[part], "x": labels, "y": y,
                     "marker": {"color": BREAKDOWN_COLORS[part]},
                     "customdata": [duration(r["breakdown"][part]) if r else "" for r in results],
                     "hovertemplate": "%{x}<br>" + BREAKDOWN_LABELS[part] + ": %{customdata}<extra></extra>"})
    totals = [r["step_seconds"] * 1e3 if r else None for r in results]
    data.append({"type": "scatter", "mode": "text", "name": "step time", "x": labels, "y": totals,
                 "text": [duration(r["step_seconds"]) if r else "" for r in results], "textposition": "top center",
                 "showlegend": False, "hoverinfo": "skip", "cliponaxis": False})
    figure = {"data": data, "layout": {
        "barmode": "stack", "height": 320, "margin": {"l": 60, "r": 10, "t": 20, "b": 60},
        "xaxis": axis(), "yaxis": axis(title={"text": "step time (ms)"}, rangemode="tozero"),
        "legend": legend_below(traceorder="normal")}}
    return figure if any(results) else no_data(figure)


def memory_figure(runs: Sequence[Mapping]) -> dict:
    """Stacked bars per pipeline stage of each configuration (GiB: params, grads,
    optimizer, activations), on a two-level x axis (configuration, stage), with each GPU
    type's capacity as a dashed line."""
    x_config, x_stage = [], []
    parts = {part: [] for part in MEMORY_PARTS}
    peaks = []
    capacities: dict[str, float] = {}
    for label, run in zip(config_labels(runs), runs):
        result = _result(run)
        stages = result["memory"]["per_stage"] if result else [None]
        for stage in stages:
            x_config.append(label)
            x_stage.append(f"stage {stage['stage']}" if stage else "–")
            for part in MEMORY_PARTS:
                parts[part].append(stage[part] / GIB if stage else None)
            peaks.append(stage["peak"] / GIB if stage else None)
        if result and result["memory"].get("capacity_bytes"):
            capacities[run["gpu_type"]] = result["memory"]["capacity_bytes"] / GIB
    x = [x_config, x_stage]
    as_text = lambda values: [binary_bytes(v * GIB) if v is not None else "" for v in values]  # noqa: E731
    data = [{"type": "bar", "name": part, "x": x, "y": parts[part], "marker": {"color": MEMORY_COLORS[part]},
             "customdata": as_text(parts[part]),
             "hovertemplate": "%{x}<br>" + part + ": %{customdata}<extra></extra>"} for part in MEMORY_PARTS]
    data.append({"type": "scatter", "mode": "markers", "name": "peak", "x": x, "y": peaks,
                 "marker": {"symbol": "line-ew-open", "size": 18, "color": "#1d2330"}, "customdata": as_text(peaks),
                 "hovertemplate": "%{x}<br>peak: %{customdata}<extra></extra>"})
    top = max((p for p in peaks if p is not None), default=0.0)
    # A capacity far above every peak would flatten the bars: the axis then ends above the
    # highest peak and the capacity is written at the top instead of drawn.
    off_scale = bool(top) and bool(capacities) and min(capacities.values()) > OFF_SCALE * top
    shapes, annotations = [], []
    for n, (gpu_type, gib) in enumerate(sorted(capacities.items())):
        if off_scale:
            annotations.append({"xref": "paper", "x": 1, "xanchor": "right", "yref": "paper", "y": 1 - 0.08 * n,
                                "yanchor": "top", "showarrow": False, "font": {"color": "#c0392b"},
                                "text": f"{gpu_type} capacity {binary_bytes(gib * GIB)} (above the scale: "
                                        f"highest peak {sig(100 * top / gib, 2)} % of it)"})
            continue
        shapes.append({"type": "line", "xref": "paper", "x0": 0, "x1": 1, "yref": "y", "y0": gib, "y1": gib,
                       "line": {"color": "#c0392b", "dash": "dash", "width": 2}})
        annotations.append({"xref": "paper", "x": 1, "xanchor": "right", "yref": "y", "y": gib, "yanchor": "bottom",
                            "text": f"{gpu_type} capacity {binary_bytes(gib * GIB)}", "showarrow": False,
                            "font": {"color": "#c0392b"}})
    yaxis = axis(title={"text": "memory per GPU (GiB)"}, rangemode="tozero")
    if off_scale:
        yaxis["range"] = [0, top * 1.3]
    figure = {"data": data, "layout": {
        "barmode": "stack", "height": 340, "margin": {"l": 60, "r": 10, "t": 20, "b": 80},
        "xaxis": axis(), "yaxis": yaxis, "shapes": shapes, "annotations": annotations,
        "legend": legend_below(traceorder="normal")}}
    return figure if any(p is not None for p in peaks) else no_data(figure)


def throughput_figure(runs: Sequence[Mapping]) -> dict:
    """Two bar charts side by side: tokens per second and MFU (%) per configuration."""
    labels = config_labels(runs)
    results = [_result(run) for run in runs]
    tokens = [r["tokens_per_second"] if r else None for r in results]
    mfu = [r["mfu"] * 100 if r else None for r in results]
    figure = {"data": [
        {"type": "bar", "name": "tokens/s", "x": labels, "y": tokens, "xaxis": "x", "yaxis": "y",
         "marker": {"color": "#2f6fd6"}, "customdata": [f"{count(t)} tokens/s" if t is not None else "" for t in tokens],
         "hovertemplate": "%{x}<br>%{customdata}<extra></extra>"},
        {"type": "bar", "name": "MFU", "x": labels, "y": mfu, "xaxis": "x2", "yaxis": "y2",
         "marker": {"color": "#2e9d5b"}, "customdata": [percent(r["mfu"]) if r else "" for r in results],
         "hovertemplate": "%{x}<br>MFU %{customdata}<extra></extra>"},
    ], "layout": {
        "height": 300, "margin": {"l": 60, "r": 10, "t": 30, "b": 60}, "showlegend": False,
        "xaxis": axis(domain=[0, 0.45]), "xaxis2": axis(domain=[0.55, 1], anchor="y2"),
        "yaxis": axis(title={"text": "tokens per second"}, rangemode="tozero"),
        "yaxis2": axis(title={"text": "MFU (%)"}, rangemode="tozero", anchor="x2")}}
    return figure if any(results) else no_data(figure)


def settings_table(runs: Sequence[Mapping]) -> list[dict]:
    """Rows {setting, label, values, differs}: settings that differ between the runs
    first (in SETTINGS order), then those they share."""
    rows = [{"setting": s, "label": SETTING_LABELS[s], "values": [run[s] for run in runs],
             "differs": len({run[s] for run in runs}) > 1} for s in SETTINGS]
    return [r for r in rows if r["differs"]] + [r for r in rows if not r["differs"]]


def csv_row(run: Mapping) -> dict:
    result = _result(run) or {}
    memory = result.get("memory", {})
    breakdown = result.get("breakdown", {})
    row = {name: run.get(name, "") for name in ("id", *SETTINGS, "state", "error")}
    row.update({name: result.get(name, "") for name in ("step_seconds", "tokens_per_second", "model_tflops_per_gpu",
                                                        "hardware_tflops_per_gpu", "mfu")})
    row.update({part: breakdown.get(part, "") for part in BREAKDOWN})
    row.update({"peak_bytes": memory.get("peak_bytes", ""), "capacity_bytes": memory.get("capacity_bytes", ""),
                "fits": memory.get("fits", "")})
    return row


def compare_csv(runs: Sequence[Mapping]) -> str:
    """One CSV line per run (CSV_COLUMNS); a run without a result has empty figures."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for run in runs:
        writer.writerow(csv_row(run))
    return out.getvalue()


def compare_figures(runs: Sequence[Mapping]) -> dict:
    """Everything the page draws from the runs."""
    return {"breakdown": step_breakdown_figure(runs), "memory": memory_figure(runs),
            "throughput": throughput_figure(runs), "settings": settings_table(runs)}
