"""What every Plotly figure shares: axes that make room for their labels and never print
an exponent, byte axes ticked in binary units, and the "no data yet" face of an empty
chart (instead of Plotly's made-up -1..1 axes). Pure: dicts in, dicts out."""
from __future__ import annotations

import math

from frontend.formatting import BINARY, sig

NO_DATA = "no data yet"


def axis(**extra) -> dict:
    """A numeric or category axis: automargin (rotated tick labels are not cut),
    exponentformat none (12,000 not 1.2e+4; 0.00001 not 1e-5)."""
    return {"automargin": True, "exponentformat": "none", "separatethousands": True, **extra}


def tick_label(value: float, divisor: float, unit: str) -> str:
    """A short tick text: 1.5 GiB, 512 MiB, 0 B (3 significant digits, zeros trimmed)."""
    text = sig(value / divisor)
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return f"{text} {unit}"


def byte_ticks(top: float, count: int = 5) -> tuple[list[float], list[str]]:
    """About `count` ticks from 0 to at least `top` bytes, at multiples of 1, 2 or 5 x 10^k
    of one binary unit. Example: top 3.2 GiB -> 0, 1, 2, 3, 4 GiB."""
    top = max(float(top), 1.0)
    divisor, unit = next((d, u) for d, u in reversed(BINARY) if top >= d)
    rough = top / divisor / count
    magnitude = 10 ** math.floor(math.log10(rough)) if rough > 0 else 1
    step = next((m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= rough), 10 * magnitude)
    if divisor == 1:
        step = max(1, round(step))
    n = math.ceil(top / divisor / step - 1e-9)
    values = [i * step * divisor for i in range(n + 1)]
    return values, [tick_label(v, divisor, unit) for v in values]


def byte_axis(top: float, **extra) -> dict:
    """An axis of bytes ticked in binary units (Plotly would print 2G, meaning 10^9)."""
    values, texts = byte_ticks(top)
    return axis(tickmode="array", tickvals=values, ticktext=texts, **extra)


def legend_below(**extra) -> dict:
    """A horizontal legend at the bottom of the figure (the container, not the plot), so
    that Plotly makes room for it however many rows it wraps into on a narrow screen."""
    return {"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0, **extra}


def no_data(figure: dict, text: str = NO_DATA) -> dict:
    """The figure with its axes hidden and `text` in the middle: what an empty chart shows."""
    layout = dict(figure["layout"])
    for key in [k for k in layout if k.startswith(("xaxis", "yaxis"))] or ["xaxis", "yaxis"]:
        layout[key] = {**layout.get(key, {}), "visible": False}
    layout["annotations"] = [{"text": text, "xref": "paper", "yref": "paper", "x": 0.5, "y": 0.5,
                              "showarrow": False, "font": {"size": 14, "color": "#667"}, "name": "no-data"}]
    layout["shapes"] = []
    return {**figure, "layout": layout}
