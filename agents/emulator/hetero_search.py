"""`dynaplane search` for a model with an encoder: homogeneous, colocated and non-colocated
candidates (issue 8), ranked by predicted throughput.

The candidate set is bounded by construction:
- LLM layouts on n GPUs are search.candidate_layouts' (tp within a node dividing the heads
  and kv heads, pp up to the layer count, micro-batch sizes from the request), zero <= 2
  (HeteroTrainer does not run zero=3);
- homogeneous: the LLM layouts with pp=1 whose tp also divides the encoder's heads (the
  trainer runs the encoder unpipelined), as a plain layout;
- colocated: every LLM layout on all N GPUs with the encoder at tp=1 and tp=2 (where the
  heads allow), dp = N / tp, zero=1;
- non-colocated: the encoder on the first N/32, N/16, N/8 or N/4 GPUs (tp=1, dp = those
  GPUs, zero=1), the LLM's layouts on the rest;
then every candidate whose static state (params, fp32 gradients, optimizer: the exact
bytes of the heaviest rank's boxes, both modules' on a colocated rank) exceeds the device
is dropped without a trace, and at most `max_candidates` are emulated, split evenly over
the three placements, in each least LLM model parallelism (tp*pp) first and least static
memory first; a variant needing more static memory than one of the same (placement, LLM
tp, pp) that did not fit is skipped.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from agents.emulator.devices import get_profile, load_profile
from agents.emulator.emulate import EmulateRequest, emulate
from agents.emulator.errors import EmulatorError
from agents.engine.shards import box_shape, rank_boxes
from agents.layout.catalog import get_config, get_model
from agents.layout.errors import LayoutError
from agents.layout.placement import place
from agents.layout.tensors import STATE_BYTES

KINDS = ("homogeneous", "colocated", "non-colocated")
ENCODER_SHARES = (32, 16, 8, 4)  # non-colocated: the encoder gets N / share GPUs


def hetero_static_bytes(model: str, layout: str) -> int:
    """The most any rank holds in params + fp32 gradients + optimizer state (zero < 3: bf16
    box + its fp32 gradient + 12 B per master element), over both modules' boxes on it."""
    spec = get_model(model)
    placement = place(spec, layout)
    ranks = {ml.offset + s * ml.dp * ml.tp for ml in placement.modules.values() for s in range(ml.pp)}
    worst = 0
    for rank in ranks:
        elems = {"param": 0, "master": 0}
        for (i, state), box in rank_boxes(placement, rank).items():
            if state in elems:
                elems[state] += int(np.prod(box_shape(spec.tensors[i], box)))
        worst = max(worst, (STATE_BYTES["param"] + 4) * elems["param"] + 12 * elems["master"])
    return worst


def _llm_layouts(request, gpus: int) -> list[tuple[str, int]]:
    from agents.emulator.search import candidate_layouts

    zero = tuple(z for z in request.zero if z <= 2) or (1,)
    return candidate_layouts(replace(request, gpus=gpus, zero=zero))


def _encoder_tps(model: str, gpus: int, gpus_per_node: int, choices=(1, 2)) -> list[int]:
    heads = get_config(model).encoder.heads
    return [tp for tp in choices if heads % tp == 0 and gpus % tp == 0 and tp <= gpus_per_node]


def _tp_pp(layout: str) -> tuple[int, int]:
    fields = {k: int(v) for k, v in (p.split("=") for p in layout.split(";")[-1].split(":")[-1].split(",")
                                     if not p.startswith("ranks"))}
    return fields.get("tp", 1), fields.get("pp", 1)


def multimodal_candidates(request, *, encoder_tp=(1, 2), shares=ENCODER_SHARES, llm_tp: tuple[int, ...] | None = None,
                          llm_pp: tuple[int, ...] | None = None) -> list[tuple[str, str, int]]:
    """(placement kind, layout, micro-batch size) for a multimodal model on request.gpus GPUs;
    `llm_tp` / `llm_pp` keep only LLM layouts with those tp / pp (a benchmark's narrower sweep)."""
    n, gpn, heads = request.gpus, request.gpus_per_node, get_config(request.model).encoder.heads

    def llm_layouts(gpus: int):
        return [(layout, mb) for layout, mb in _llm_layouts(request, gpus)
                if (llm_tp is None or _tp_pp(layout)[0] in llm_tp) and (llm_pp is None or _tp_pp(layout)[1] in llm_pp)]

    out = []
    for layout, mb in llm_layouts(n):
        tp, pp = _tp_pp(layout)
        if pp == 1 and heads % tp == 0:
            out.append(("homogeneous", layout, mb))
        for etp in _encoder_tps(request.model, n, gpn, encoder_tp):
            if pp == 1 and etp == tp:
                continue  # the homogeneous layout
            out.append(("colocated", f"encoder:tp={etp},dp={n // etp},zero=1;llm:{layout}", mb))
    for share in shares:
        ne = n // share
        if ne < 1 or n % share or n - ne < 1:
            continue
        for layout, mb in llm_layouts(n - ne):
            out.append(("non-colocated", f"encoder:dp={ne},zero=1,ranks=0-{ne - 1};llm:{layout},ranks={ne}-{n - 1}", mb))
    return out


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
            need = hetero_static_bytes(request.model, layout)
        except LayoutError as exc:
            dropped.append({"layout": layout, "micro_batch": mb, "placement": kind, "reason": str(exc)})
            continue
        if need > profile.hbm_bytes:
            dropped.append({"layout": layout, "micro_batch": mb, "placement": kind,
                            "reason": f"static state {need / 2**30:.1f} GiB > {profile.hbm_bytes / 2**30:.1f} GiB"})
            continue
        feasible[kind].append((_tp_pp(layout), need, mb, layout))
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
