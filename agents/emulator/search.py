"""`dynaplane compare` and `dynaplane search`: several configurations emulated side by side,
and the feasible layouts for a GPU count ranked by predicted throughput (what resize
proposals use).

Search enumerates the layouts the trainer can run (search_space.py: tp within a node
dividing the heads, and dividing the kv heads or a multiple of them, pp up to the layer count, dp the rest; zero 1 and 3;
micro-batch sizes that divide the per-replica batch; for a model with an encoder also
colocated and non-colocated placements), drops those whose static state alone does not fit
the device, emulates the rest, cheapest-looking first, and keeps the K fastest that fit.
"""
from __future__ import annotations

from dataclasses import replace

from agents.emulator.devices import get_profile, load_profile
from agents.emulator.emulate import EmulateRequest, check_request, emulate
from agents.emulator.errors import EmulatorError
from agents.emulator.search_space import (KINDS, SearchRequest, candidate_layouts, fields_of, multimodal_candidates,
                                          ranked_candidates, static_bytes, tp_pp, top_fitting)
from agents.layout.catalog import get_config
from agents.layout.errors import LayoutError

__all__ = ["SearchRequest", "compare", "search", "search_multimodal", "top_fitting"]


def compare(requests: list[EmulateRequest], progress=None) -> list[dict]:
    """Each configuration's emulate() result, in the order given; a configuration that is
    invalid gets {"layout", "error"} instead of stopping the others."""
    out = []
    for n, request in enumerate(requests):
        if progress:
            progress(f"[{n + 1}/{len(requests)}] {request.layout}")
        try:
            out.append(emulate(request, progress=progress))
        except EmulatorError as exc:
            out.append({"layout": request.layout, "error": str(exc)})
    return out


def search(request: SearchRequest, progress=None, **narrow) -> dict:
    """The best layouts of any model. `narrow`: for a model with an encoder,
    multimodal_candidates' keyword arguments (default: the full bounded set)."""
    try:
        multimodal = get_config(request.model).encoder is not None
    except LayoutError as exc:
        raise EmulatorError(str(exc)) from exc
    if multimodal:  # homogeneous, colocated and non-colocated candidates, ranked per placement
        return search_multimodal(request, progress, **narrow)
    if narrow:
        raise EmulatorError(f"{request.model} has no encoder: {sorted(narrow)} narrow a multimodal search only")
    profile = load_profile(request.profile) if request.profile else get_profile(request.gpu)
    candidates = candidate_layouts(request)
    if not candidates:
        raise EmulatorError(f"no layout of {request.model} runs on {request.gpus} GPUs with global batch "
                            f"{request.global_batch} (tp must divide the heads, divide the kv heads or be a "
                            f"multiple of them, tp <= "
                            f"{request.gpus_per_node} GPUs per node)")
    feasible, dropped = ranked_candidates(request, candidates, profile.hbm_bytes)
    results = []
    base = EmulateRequest(request.model, "", request.gpus, request.gpu, request.global_batch, 1, request.seq,
                          request.recompute, request.gpus_per_node, request.profile,
                          sequence_parallel=request.sequence_parallel)
    too_big: list[tuple[dict, int]] = []  # (layout fields, micro-batch) that did not fit
    emulated = 0
    for _, layout, mb in feasible:
        if emulated == request.max_candidates:
            break
        fields = fields_of(layout)
        if any(all(fields[k] == f[k] for k in ("tp", "pp", "dp")) and fields.get("zero", 0) <= f.get("zero", 0)
               and mb >= fmb for f, fmb in too_big):
            dropped.append({"layout": layout, "micro_batch": mb,
                            "reason": "needs more memory than a variant that already does not fit"})
            continue
        emulated += 1
        emulation = replace(base, layout=layout, micro_batch=mb)
        check_request(emulation)
        if progress:
            progress(f"[{emulated}/{min(len(feasible), request.max_candidates)}] {layout} micro-batch {mb}")
        try:
            result = emulate(emulation)
        except EmulatorError as exc:
            dropped.append({"layout": layout, "micro_batch": mb, "reason": str(exc)})
            continue
        if not result["memory"]["fits"]:
            too_big.append((fields, mb))
        (results if result["memory"]["fits"] else dropped).append(
            result if result["memory"]["fits"] else
            {"layout": layout, "micro_batch": mb,
             "reason": f"peak {result['memory']['peak_bytes'] / 2**30:.1f} GiB > "
                       f"{result['memory']['capacity_bytes'] / 2**30:.1f} GiB"})
    return {"model": request.model, "gpus": request.gpus, "gpu": profile.name, "global_batch": request.global_batch,
            "seq": request.seq, "candidates": len(candidates), "emulated": emulated,
            "top": top_fitting(results, request.top), "does_not_fit": dropped}


def search_multimodal(request, progress=None, **narrow) -> dict:
    """`narrow`: multimodal_candidates' keyword arguments (default: the full bounded set)."""
    profile = load_profile(request.profile) if request.profile else get_profile(request.gpu)
    candidates = multimodal_candidates(request, **narrow)
    if not candidates:
        raise EmulatorError(f"no layout of {request.model} runs on {request.gpus} GPUs with global batch "
                            f"{request.global_batch}")
    feasible: dict[str, list] = {k: [] for k in KINDS}
    dropped = []
    for kind, layout, mb in candidates:
        try:
            need = static_bytes(request.model, layout)
        except LayoutError as exc:
            dropped.append({"layout": layout, "micro_batch": mb, "placement": kind, "reason": str(exc)})
            continue
        if need > profile.hbm_bytes:
            dropped.append({"layout": layout, "micro_batch": mb, "placement": kind,
                            "reason": f"static state {need / 2**30:.1f} GiB > {profile.hbm_bytes / 2**30:.1f} GiB"})
            continue
        feasible[kind].append((tp_pp(layout), need, mb, layout))
    per_kind = max(1, request.max_candidates // len(KINDS))
    results, emulated = [], 0
    for kind in KINDS:
        too_big: dict[tuple, int] = {}
        done = 0
        for (tp, pp), need, mb, layout in sorted(feasible[kind], key=lambda c: (c[0][0] * c[0][1], c[1], c[2])):
            if done >= per_kind:
                break
            if need >= too_big.get((tp, pp), float("inf")):
                continue
            done += 1
            emulated += 1
            if progress:
                progress(f"[{kind} {done}/{per_kind}] {layout} micro-batch {mb}")
            try:
                result = emulate(EmulateRequest(request.model, layout, request.gpus, request.gpu, request.global_batch,
                                                mb, request.seq, request.recompute, request.gpus_per_node,
                                                request.profile))
            except EmulatorError as exc:
                dropped.append({"layout": layout, "micro_batch": mb, "placement": kind, "reason": str(exc)})
                continue
            if result["memory"]["fits"]:
                results.append(result)
            else:
                too_big[(tp, pp)] = min(need, too_big.get((tp, pp), need))
                dropped.append({"layout": layout, "micro_batch": mb, "placement": kind,
                                "reason": f"peak {result['memory']['peak_bytes'] / 2**30:.1f} GiB > "
                                          f"{result['memory']['capacity_bytes'] / 2**30:.1f} GiB"})
    results.sort(key=lambda r: -r["tokens_per_second"])
    best = {kind: next((r for r in results if r["placement"] == kind), None) for kind in KINDS}
    return {"model": request.model, "gpus": request.gpus, "gpu": profile.name, "global_batch": request.global_batch,
            "seq": request.seq, "candidates": len(candidates), "emulated": emulated, "top": results[:request.top],
            "best_by_placement": best, "does_not_fit": dropped}
