"""Where each rank of a layout sits in the parallel grid, for drawing the layout on the
GPUs. Pure: the layout string and the job's rank slots in, one row per rank out.

Rank order (docs/contracts.md section 1, TP fastest, PP slowest):
rank = offset + tp_rank + tp*(cp_rank + cp*(dp_rank + dp*pp_rank)).
Worked example: tp=2,pp=2,dp=2: rank 5 = 1 + 2*(0 + 1*(0 + 2*1)) -> pp 1, dp 0, tp 1.

Heterogeneous layouts (a layout per module, issue 8) are drawn per module: every rank row
says which modules use it (`role`: "encoder", "llm", or "encoder+llm" when colocated) and
carries one coordinate text per module (`parts`), so the page colours a GPU by its module
and shows both coordinates on a colocated GPU; `module_legend` names each module's layout
and ranks.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace

from parallelism.layout.spec import parse_layout


def rank_coordinates(layout: str, slots: Iterable[Mapping]) -> list[dict]:
    """Per rank slot {rank, node, gpu}: its coordinates in every module that uses it,
    [{module, pp, dp, tp, cp}], a short label ("pp0 dp1 tp0"), its `role` and one `parts`
    entry {module, text} per module. A rank outside every module (possible while a switch
    runs) gets no coordinates and role "none"."""
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
        parts = [{"module": c["module"], "text": f"pp{c['pp']} dp{c['dp']} tp{c['tp']}" + (f" cp{c['cp']}" if c["cp"] else "")}
                 for c in coordinates]
        label = "; ".join((f"{p['module']}: " if parsed.is_heterogeneous else "") + p["text"] for p in parts)
        role = ("+".join(c["module"] for c in coordinates) if parsed.is_heterogeneous
                else ("all" if coordinates else "none")) or "none"
        out.append({"rank": slot["rank"], "node": slot["node"], "gpu": slot["gpu"], "coordinates": coordinates,
                    "label": label, "role": role, "parts": parts})
    return out


def module_legend(layout: str) -> list[dict]:
    """One entry per module of a heterogeneous layout: {module, layout (its own degrees),
    ranks ("0-1"), colocated}; empty for a plain layout (one module, nothing to tell apart)."""
    parsed = parse_layout(layout)
    if not parsed.is_heterogeneous:
        return []
    return [{"module": m.module, "layout": replace(m, first_rank=None).to_string(False),
             "ranks": f"{m.offset}-{m.last_rank}" if m.world > 1 else str(m.offset),
             "colocated": m.first_rank is None} for m in parsed.modules]
