"""What a switch will do, for the page before it is confirmed and for the transition's
detail page: the routing plan reduced to plain numbers (GET /api/jobs/{id}/plan).

Pure: the same plan_routes(model, src, dst, options) the resize service and the ranks
compute, so the preview's fingerprint is the one the transition will carry.
"""
from __future__ import annotations

import numpy as np

from parallelism.planner.estimate import estimate_seconds
from parallelism.planner.plan import PlanOptions, RoutingPlan, plan_routes
from parallelism.layout.tensors import STATE_BYTES, Model

MAX_MATRIX_WORLD = 512  # beyond this the src x dst matrix is left out (it would be 2 MB+ of JSON)


def route_matrix(plan: RoutingPlan) -> np.ndarray:
    """Bytes sent from source rank i (row) to destination rank j (column), all rounds."""
    out = np.zeros((plan.world, plan.world))
    for item in plan.items:
        r = item.route
        if len(r.src):
            np.add.at(out, (r.src, r.dst), r.elements(r.boxes) * float(STATE_BYTES[item.state]))
    return out


def plan_preview_data(plan: RoutingPlan) -> dict:
    """The plan as the page draws it: summary, matrix, bytes and seconds per round, and the
    predicted state bytes per rank after each round (`wave_after`, rounds + 1 rows: row 0 is
    before the first round) and at its peak within each round (`wave_peak`)."""
    stats = plan.stats
    after, peak = plan.waves
    _, round_seconds = estimate_seconds(stats, plan.options.network)
    send = stats.send_intra + stats.send_inter
    summary = plan.summary()
    return {
        "model": plan.model.name,
        "source_layout": summary["src"],
        "destination_layout": summary["dst"],
        "world": plan.world,
        "summary": summary,
        "matrix": route_matrix(plan).astype(np.int64).tolist() if plan.world <= MAX_MATRIX_WORLD else None,
        "round_bytes": [int(x) for x in send.sum(axis=1)],
        "round_seconds": round_seconds,
        "wave_after": after.astype(np.int64).tolist(),
        "wave_peak": peak.astype(np.int64).tolist(),
        "estimated_seconds": summary["estimated_seconds"],
        "staging_bytes": plan.options.staging_bytes,
    }


def plan_preview(model: Model, src: str, dst: str, *, gpus_per_node: int, staging_bytes: int,
                 map_ranks: bool = True, process_of: list[int] | None = None) -> dict:
    """Plan src -> dst (LayoutError when either layout breaks a rule) and reduce it: with
    the best device map (`map_ranks`), as a resize plans it, or with the map `process_of` a
    transition ran (None: its ranks kept their numbers)."""
    options = PlanOptions(gpus_per_node=gpus_per_node, staging_bytes=staging_bytes,
                          map_ranks=map_ranks and process_of is None)
    plan = plan_routes(model, src, dst, options, process_of=process_of)
    return plan_preview_data(plan)
