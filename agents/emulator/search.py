"""`dynaplane compare` and `dynaplane search`: several configurations emulated side by side,
and the feasible layouts for a GPU count ranked by predicted throughput (what resize
proposals use).

Search enumerates the layouts the trainer can run (tp within a node dividing the heads and
the kv heads, pp up to the layer count, dp the rest; zero 1 and 3; micro-batch sizes that
divide the per-replica batch), drops those whose static state alone (params, gradients,
optimizer: the exact size of the heaviest rank's boxes, no trace needed) does not fit the
device, emulates the rest, cheapest-looking first, and keeps the K fastest that fit.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from agents.emulator.devices import get_profile, load_profile
from agents.emulator.emulate import EmulateRequest, check_request, emulate
from agents.emulator.errors import EmulatorError
from agents.engine.shards import box_shape, rank_boxes
from agents.layout.catalog import get_config, get_model
from agents.layout.errors import LayoutError
from agents.layout.placement import place
from agents.layout.tensors import STATE_BYTES


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


@dataclass(frozen=True)
class SearchRequest:
    model: str
    gpus: int
    gpu: str
    global_batch: int
    seq: int
    top: int = 5
    gpus_per_node: int = 8
    recompute: str = "none"
    profile: str | None = None
    micro_batches: tuple[int, ...] = (1, 2, 4)
    zero: tuple[int, ...] = (1, 3)
    max_candidates: int = 24
    sequence_parallel: bool = False


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(request: SearchRequest) -> list[tuple[str, int]]:
    """(layout, micro-batch size) pairs the trainer can run on exactly `gpus` GPUs."""
    c = get_config(request.model).llm
    out = []
    for tp in _divisors(request.gpus):
        if tp > request.gpus_per_node or c.heads % tp or c.kv_heads % tp or (c.experts and tp > 1):
            continue
        for pp in _divisors(request.gpus // tp):
            if pp > c.layers or (c.tied and (tp > 1 or pp > 1)):
                continue
            dp = request.gpus // (tp * pp)
            for zero in request.zero:
                if zero == 3 and dp == 1:
                    continue  # nothing to shard over
                for mb in request.micro_batches:
                    if request.global_batch % (mb * dp):
                        continue
                    out.append((f"tp={tp},pp={pp},dp={dp},zero={zero}", mb))
    return out


def static_bytes(model: str, layout: str) -> int:
    """The most any rank holds in params + fp32 gradients + optimizer state in the trainer
    (zero < 3: bf16 box + fp32 gradient of it + 12 B per master element; zero 3: 16 B per
    master element), from the contract's boxes; checked against the tracer in the tests."""
    spec = get_model(model)
    placement = place(spec, layout)
    ml = next(iter(placement.modules.values()))
    worst = 0
    for stage in range(ml.pp):
        rank = stage * ml.dp * ml.tp
        elems = {"param": 0, "master": 0}
        for (i, state), box in rank_boxes(placement, rank).items():
            if state in elems:
                elems[state] += int(np.prod(box_shape(spec.tensors[i], box)))
        if ml.zero == 3:
            total = 16 * elems["master"]
        else:
            total = (STATE_BYTES["param"] + 4) * elems["param"] + 12 * elems["master"]
        worst = max(worst, total)
    return worst


def _fields(layout: str) -> dict[str, int]:
    return {k: int(v) for k, v in (part.split("=") for part in layout.split(","))}


def _model_parallel(layout: str) -> int:
    fields = _fields(layout)
    return fields.get("tp", 1) * fields.get("pp", 1)


def search(request: SearchRequest, progress=None) -> dict:
    try:
        multimodal = get_config(request.model).encoder is not None
    except LayoutError as exc:
        raise EmulatorError(str(exc)) from exc
    if multimodal:  # homogeneous, colocated and non-colocated candidates (hetero_search.py)
        from agents.emulator.hetero_search import search_multimodal

        return search_multimodal(request, progress)
    profile = load_profile(request.profile) if request.profile else get_profile(request.gpu)
    candidates = candidate_layouts(request)
    if not candidates:
        raise EmulatorError(f"no layout of {request.model} runs on {request.gpus} GPUs with global batch "
                            f"{request.global_batch} (tp must divide the heads and kv heads, tp <= "
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
        fields = _fields(layout)
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


def ranked_candidates(request: SearchRequest, candidates: list[tuple[str, int]],
                      capacity_bytes: int) -> tuple[list[tuple[int, str, int]], list[dict]]:
    """The candidates worth emulating, likeliest fastest first, as (static bytes, layout,
    micro-batch), and {layout, micro_batch, reason} for those whose static state alone
    does not fit `capacity_bytes` (or that break a layout rule)."""
    feasible, dropped = [], []
    for layout, mb in candidates:
        try:
            need = static_bytes(request.model, layout)
        except LayoutError as exc:
            dropped.append({"layout": layout, "micro_batch": mb, "reason": str(exc)})
            continue
        if need > capacity_bytes:
            dropped.append({"layout": layout, "micro_batch": mb,
                            "reason": f"static state {need / 2**30:.1f} GiB > {capacity_bytes / 2**30:.1f} GiB"})
        else:
            feasible.append((need, layout, mb))
    # Likeliest fastest first: the least model parallelism (tp * pp: fewer collectives on the
    # critical path, no bubble). Within one (tp, pp), the least memory first (ZeRO-3, the
    # smallest micro-batch): when that does not fit, no variant with more memory is tried.
    feasible.sort(key=lambda x: (_model_parallel(x[1]), _fields(x[1])["tp"], -_fields(x[1]).get("zero", 0), x[2]))
    return feasible, dropped


def top_fitting(results: list[dict], top: int) -> list[dict]:
    """The `top` fastest (tokens/s) of emulate() results that fit in memory (the compare
    page's "top K from search" keeps the same ones: frontend compare-store.js searchTop)."""
    fitting = [r for r in results if r.get("memory", {}).get("fits")]
    return sorted(fitting, key=lambda r: -r["tokens_per_second"])[:top]
