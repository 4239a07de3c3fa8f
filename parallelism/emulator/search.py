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

from parallelism.emulator.devices import get_profile, load_profile
from parallelism.emulator.emulate import EmulateRequest, emulate
from parallelism.emulator.errors import EmulatorError
from parallelism.emulator.search_space import KINDS, Candidate, SearchRequest, candidates, ranked_candidates, top_fitting

__all__ = ["SearchRequest", "compare", "search", "top_fitting"]


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
    """The best layouts of any model on request.gpus GPUs: its candidates (search_space.
    candidates; `narrow`, for a model with an encoder, multimodal_candidates' keyword
    arguments) ranked by one rule (ranked_candidates), emulated in that order, at most
    request.max_candidates of them (shared evenly by the placements of a model with an
    encoder), and the request.top fastest that fit. A model with an encoder also gets the
    best result of each placement (`best_by_placement`)."""
    profile = load_profile(request.profile) if request.profile else get_profile(request.gpu)
    found = candidates(request, **narrow)
    if not found:
        raise EmulatorError(f"no layout of {request.model} runs on {request.gpus} GPUs with global batch "
                            f"{request.global_batch}" + ("" if request.model_config.encoder else
                                                         f" (tp must divide the heads, divide the kv heads or "
                                                         f"be a multiple of them, tp <= {request.gpus_per_node} "
                                                         f"GPUs per node)"))
    feasible, dropped = ranked_candidates(request, found, profile.hbm_bytes)
    kinds = list(dict.fromkeys(kind for kind, _, _ in found))  # KINDS' order, or [None]
    quota = max(1, request.max_candidates // len(kinds))
    base = EmulateRequest(request.model, "", request.gpus, request.gpu, request.global_batch, 1, request.seq,
                          request.recompute, request.gpus_per_node, request.profile,
                          sequence_parallel=request.sequence_parallel, stack=request.stack,
                          precision=request.precision)
    results: list[dict] = []
    emulated = 0
    for kind in kinds:
        outgrown: list[Candidate] = []  # tried and did not fit
        done, of_kind = 0, [c for c in feasible if c.kind == kind]
        bound = min(quota, len(of_kind))
        where = f"{kind} " if kind else ""
        for candidate in of_kind:
            if done == quota:
                break
            if any(_needs_as_much(candidate, big) for big in outgrown):
                dropped.append(candidate.dropped("needs more memory than a variant that already does not fit"))
                continue
            done += 1
            emulated += 1
            if progress:
                progress(f"[{where}{done}/{bound}] {candidate.layout} micro-batch {candidate.micro_batch}")
            try:
                result = emulate(replace(base, layout=candidate.layout, micro_batch=candidate.micro_batch))
            except EmulatorError as exc:
                dropped.append(candidate.dropped(str(exc)))
                continue
            if result["memory"]["fits"]:
                results.append(result)
            else:
                outgrown.append(candidate)
                dropped.append(candidate.dropped(f"peak {result['memory']['peak_bytes'] / 2**30:.1f} GiB > "
                                                 f"{result['memory']['capacity_bytes'] / 2**30:.1f} GiB"))
    ranked = top_fitting(results, len(results))
    out = {"model": request.model, "gpus": request.gpus, "gpu": profile.name, "global_batch": request.global_batch,
           "seq": request.seq, "candidates": len(found), "emulated": emulated, "top": ranked[:request.top]}
    if kinds != [None]:
        out["best_by_placement"] = {kind: next((r for r in ranked if r["placement"] == kind), None) for kind in KINDS}
    out["does_not_fit"] = dropped
    return out


def _needs_as_much(candidate: Candidate, big: Candidate) -> bool:
    """`candidate` needs at least the memory of `big` (same LLM tp and pp, no less static
    state, no smaller micro-batch), which did not fit: not worth emulating."""
    return (candidate.tp_pp == big.tp_pp and candidate.need >= big.need
            and candidate.micro_batch >= big.micro_batch)
