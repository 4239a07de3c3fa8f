"""The elastic page's cluster timeline: the GPUs each job held over wall-clock time, built
from the jobs' starts, their committed layout switches (the layout history) and their ends.
Pure: plain data in, a Plotly figure out (frontend/elastic_history.py reads the rows).

A job's allocation is a step function: `gpus` from `start`, each change's `gpus` from its
`at`, 0 from `end`. The traces are stacked (one per job, in start order) on the union of
every job's event times, so the top of the stack is the cluster's allocated GPUs and two
jobs of one size never hide each other; each switch is a marker on its job's trace with
its reason on hover.
"""
from __future__ import annotations

import html
import textwrap
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone

from frontend.figure_style import axis, legend_below, no_data

JOB_COLORS = ("#2f6fd6", "#d79a1c", "#2e9d5b", "#8e44ad", "#c0392b", "#16a085", "#7f8c8d", "#d35400")
HOVER_WIDTH = 64  # characters per line of a reason in the hover box
MARKER_SIZE = 11


def plotly_time(at: datetime) -> str:
    """A time as Plotly's date axis reads it: UTC, no offset (Plotly ignores offsets)."""
    if at.tzinfo is not None:
        at = at.astimezone(timezone.utc).replace(tzinfo=None)
    return at.strftime("%Y-%m-%d %H:%M:%S.%f")


def hover_text(text: str) -> str:
    """`text` safe in a Plotly hover box (which reads a little HTML), wrapped into lines."""
    return "<br>".join(html.escape(line, quote=False) for line in textwrap.wrap(text, HOVER_WIDTH)) or ""


def gpus_at(job: Mapping, at: datetime) -> int:
    """The GPUs `job` held at `at` (0 before its start and from its end)."""
    if at < job["start"] or (job.get("end") is not None and at >= job["end"]):
        return 0
    held = job["gpus"]
    for change in job.get("changes", ()):
        if change["at"] <= at:
            held = change["gpus"]
    return held


def change_text(job: Mapping, change: Mapping) -> str:
    """A switch's hover: "train-a: 4 → 2 GPUs (#12, resize)<br>shrank to 2 (dp=2): ..."."""
    head = f"{job['name']}: {change['gpus_from']} → {change['gpus']} GPUs"
    tags = [f"#{change['transition']}" if change.get("transition") is not None else "", change.get("kind") or ""]
    tags = [t for t in tags if t]
    head += f" ({', '.join(tags)})" if tags else ""
    reason = change.get("reason") or ""
    return html.escape(head, quote=False) + (f"<br>{hover_text(reason)}" if reason else "")


def allocation_figure(jobs: Iterable[Mapping], now: datetime) -> dict:
    """The timeline (module docstring). Each job: {name, start, gpus (at its start),
    changes: [{at, gpus_from, gpus, reason, kind, transition}] oldest first, end (None: it
    holds its GPUs now)}; times are aware datetimes. Jobs that never started are left out;
    no job: "no data yet"."""
    jobs = sorted((j for j in jobs if j.get("start") is not None), key=lambda j: (j["start"], j["name"]))
    times = sorted({now, *(j["start"] for j in jobs), *(j["end"] for j in jobs if j.get("end") is not None),
                    *(c["at"] for j in jobs for c in j.get("changes", ()))})
    if jobs:
        times = [t for t in times if t >= jobs[0]["start"]]
    xs = [plotly_time(t) for t in times]
    data = []
    for i, job in enumerate(jobs):
        switched = {}
        for change in job.get("changes", ()):
            switched[change["at"]] = change_text(job, change)  # (two at one instant: the later one)
        ys, texts, sizes = [], [], []
        for t in times:
            held = gpus_at(job, t)
            ys.append(held)
            if t in switched:
                texts.append(switched[t])
            elif t == job["start"]:
                texts.append(f"{job['name']}: started on {held} GPU{'' if held == 1 else 's'}")
            elif job.get("end") is not None and t == job["end"]:
                texts.append(f"{job['name']}: ended, its GPUs freed")
            else:
                texts.append(f"{job['name']}: {held} GPU{'' if held == 1 else 's'}" if held else
                             f"{job['name']}: not running")
            sizes.append(MARKER_SIZE if t in switched else 0)
        color = JOB_COLORS[i % len(JOB_COLORS)]
        data.append({"type": "scatter", "mode": "lines+markers", "name": job["name"], "x": xs, "y": ys,
                     "stackgroup": "gpus", "line": {"shape": "hv", "width": 1.5, "color": color},
                     "fillcolor": color + "55",
                     "marker": {"size": sizes, "symbol": "diamond", "color": color,
                                "line": {"width": 1, "color": "#1d2330"}},
                     "text": texts, "hovertemplate": "%{text}<extra></extra>",
                     "meta": {"switches": len(switched)}})
    top = max((sum(trace["y"][k] for trace in data) for k in range(len(times))), default=0)
    figure = {
        "data": data,
        "layout": {"height": 300, "margin": {"l": 50, "r": 10, "t": 10, "b": 40}, "hovermode": "closest",
                   "xaxis": axis(type="date", title={"text": "time (UTC)"}),
                   "yaxis": axis(title={"text": "GPUs held"}, rangemode="tozero", dtick=1 if top <= 16 else None),
                   "legend": legend_below(traceorder="normal")},
    }
    return figure if jobs else no_data(figure)
