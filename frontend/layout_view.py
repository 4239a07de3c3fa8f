"""Where each rank of a layout sits in the parallel grid, for drawing the layout on the
GPUs. Pure: the layout string and the job's rank slots in, one row per rank out.

Rank order (CONTRACTS section 1, TP fastest, PP slowest):
rank = offset + tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)).
Worked example: tp=2,pp=2,dp=2: rank 5 = 1 + 2*(0 + 1*(0 + 2*1)) -> pp 1, dp 0, tp 1.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from agents.layout.spec import parse_layout


def rank_coordinates(layout: str, slots: Iterable[Mapping]) -> list[dict]:
    """Per rank slot {rank, node, gpu}: its coordinates in every module that uses it,
    [{module, pp, dp, tp, cp}], and a short label ("pp0 dp1 tp0"). A rank outside every
    module (possible while a switch runs) gets no coordinates."""
    parsed = parse_layout(layout)
    out = []
    for slot in sorted(slots, key=lambda s: s["rank"]):
        coordinates = []
        for m in parsed.modules:
            local = slot["rank"] - m.offset
            if not 0 <= local < m.world:
                continue
            tp, rest = local % m.tp, local // m.tp
            cp, rest = rest % m.cp, rest // m.cp
            dp, pp = rest % m.dp, rest // m.dp
            coordinates.append({"module": m.module, "pp": pp, "dp": dp, "tp": tp, "cp": cp})
        label = "; ".join(
            (f"{c['module']}: " if parsed.is_heterogeneous else "")
            + f"pp{c['pp']} dp{c['dp']} tp{c['tp']}" + (f" cp{c['cp']}" if c["cp"] else "")
            for c in coordinates)
        out.append({"rank": slot["rank"], "node": slot["node"], "gpu": slot["gpu"], "coordinates": coordinates,
                    "label": label})
    return out
