"""The compare page's "take the top K from search": the candidates worth emulating for one
setting, run on an agent (task emulate.search), never in the web process (it needs the
tracer's modules, and torch with them).

Only the cheap half of `dynaplane search` runs here: enumerate the layouts the trainer can
run (search_space.candidates, the page's micro-batch only) and rank them by the static
state check (search_space.ranked_candidates). The page then emulates the first 3 x K as one
comparison on the agents and keeps the K fastest that fit (search_space.top_fitting, in JS
compare-store.js searchTop): emulating them one after another here would take minutes.
"""
from __future__ import annotations

from parallelism.emulator.devices import get_profile
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.search_space import SearchRequest, candidates, ranked_candidates
from parallelism.layout.errors import LayoutError

TRIED_PER_KEPT = 3  # candidates emulated per layout the page keeps


def search_candidates(*, model: str, gpus: int, gpu: str, global_batch: int, micro_batch: int, seq: int,
                      top: int, recompute: str = "none", gpus_per_node: int = 8) -> dict:
    """{"top", "candidates" (how many layouts the trainer can run), "layouts" (the first
    TRIED_PER_KEPT x top of those whose static state fits, likeliest fastest first),
    "dropped" ([{layout, micro_batch, reason}])}. EmulatorError when none is left."""
    query = SearchRequest(model=model, gpus=gpus, gpu=gpu, global_batch=global_batch, seq=seq, top=top,
                          recompute=recompute, gpus_per_node=gpus_per_node, micro_batches=(micro_batch,))
    try:
        found = candidates(query)
        feasible, dropped = ranked_candidates(query, found, get_profile(gpu).hbm_bytes)
    except LayoutError as exc:
        raise EmulatorError(str(exc)) from exc
    if not feasible:
        reasons = "; ".join(f"{d['layout']}: {d['reason']}" for d in dropped[:4])
        raise EmulatorError(f"no layout of {model} runs on {gpus} GPU{'s' * (gpus != 1)} with global batch "
                            f"{global_batch} and micro-batch {micro_batch}" + (f" ({reasons})" if reasons else ""))
    return {"top": top, "candidates": len(found),
            "layouts": [c.layout for c in feasible[:TRIED_PER_KEPT * top]], "dropped": dropped}
