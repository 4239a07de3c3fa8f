"""The search space of `dynaplane search` and of the compare page's "top K": the layouts the
trainer can run on N GPUs (for a model with an encoder, also its colocated and
non-colocated placements), the exact static state of each (no trace needed) to drop those
that cannot fit, and the order they are worth emulating in. Pure: no trace, no torch op.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from parallelism.emulator.errors import EmulatorError
from parallelism.engine.shards import box_shape, rank_boxes
from parallelism.layout.errors import LayoutError
from parallelism.layout.model_request import ModelConfig, NamesAModel, resolved_field
from parallelism.layout.placement import place
from parallelism.layout.tensors import STATE_BYTES, Model


@dataclass(frozen=True)
class SearchRequest(NamesAModel):
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
    # How every candidate runs (emulate.EmulateRequest's fields): the program it used and its precision
    stack: str = "program"
    precision: str = "bf16"
    model_config: ModelConfig | None = resolved_field()  # `model` resolved once (NamesAModel)
    model_error = EmulatorError


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(request: SearchRequest) -> list[tuple[str, int]]:
    """(layout, micro-batch size) pairs the trainer can run on exactly `gpus` GPUs. A MoE
    decoder's also with every ep dividing dp and its experts (parallelism/training/expert_parallel.py);
    the multimodal trainer runs MoE layers unsharded (tp = ep = 1)."""
    c = request.model_config.llm
    decoder_only = request.model_config.encoder is None
    out = []
    for tp in _divisors(request.gpus):
        # kv heads fewer than tp are replicated (parallelism/training/kv_heads.py): tp a multiple of them.
        kv_fits = c.kv_heads % tp == 0 or tp % c.kv_heads == 0
        if tp > request.gpus_per_node or c.heads % tp or not kv_fits or (c.experts and tp > 1 and not decoder_only):
            continue
        for pp in _divisors(request.gpus // tp):
            if pp > c.layers:
                continue
            dp = request.gpus // (tp * pp)
            eps = [e for e in _divisors(dp) if c.experts % e == 0] if c.experts and decoder_only else [1]
            for ep in eps:
                for zero in request.zero:
                    if zero == 3 and dp == 1:
                        continue  # nothing to shard over
                    for mb in request.micro_batches:
                        if request.global_batch % (mb * dp):
                            continue
                        out.append((f"tp={tp},pp={pp},dp={dp}{f',ep={ep}' if ep > 1 else ''},zero={zero}", mb))
    return out


def static_bytes(model: Model, layout: str) -> int:
    """The most any rank holds in params + fp32 gradients + optimizer state in the trainer,
    over every module's boxes on it (zero < 3: bf16 box + its fp32 gradient + 12 B per
    master element; zero 3: 16 B per master element), from the contract's boxes; checked
    against the tracer in the tests. The heaviest rank is the first of a pipeline stage."""
    spec = model
    placement = place(spec, layout)
    zero3 = {name for name, ml in placement.modules.items() if ml.zero == 3}
    ranks = {ml.offset + s * ml.dp * ml.tp for ml in placement.modules.values() for s in range(ml.pp)}
    worst = 0
    for rank in ranks:
        total = 0
        for (i, state), box in rank_boxes(placement, rank).items():
            tensor = spec.tensors[i]
            elems = math.prod(box_shape(tensor, box))
            sharded = tensor.split.module in zero3
            if state == "master":
                total += (16 if sharded else 12) * elems
            elif state == "param" and not sharded:
                total += (STATE_BYTES["param"] + 4) * elems
        worst = max(worst, total)
    return worst


@dataclass(frozen=True)
class Candidate:
    """A layout worth emulating: `kind` is the placement of a model with an encoder
    (KINDS), None for a decoder-only model; `need` its static bytes (static_bytes)."""

    kind: str | None
    layout: str
    micro_batch: int
    need: int

    @property
    def tp_pp(self) -> tuple[int, int]:
        return tp_pp(self.layout)

    def dropped(self, reason: str) -> dict:
        """The {layout, micro_batch[, placement], reason} row of a candidate left out."""
        return {"layout": self.layout, "micro_batch": self.micro_batch,
                **({"placement": self.kind} if self.kind else {}), "reason": reason}


def candidates(request: SearchRequest, **narrow) -> list[tuple[str | None, str, int]]:
    """(placement kind, layout, micro-batch size) of every layout the trainers can run on
    exactly request.gpus GPUs: the plain layouts of a decoder-only model (kind None), the
    three placements of a model with an encoder (multimodal_candidates; `narrow` its
    keyword arguments)."""
    if request.model_config.encoder is not None:
        return multimodal_candidates(request, **narrow)
    if narrow:
        raise EmulatorError(f"{request.model} has no encoder: {sorted(narrow)} narrow a multimodal search only")
    return [(None, layout, mb) for layout, mb in candidate_layouts(request)]


def ranked_candidates(request: SearchRequest, found: list[tuple[str | None, str, int]],
                      capacity_bytes: int) -> tuple[list[Candidate], list[dict]]:
    """The candidates worth emulating, likeliest fastest first, and the rows of those whose
    static state alone does not fit `capacity_bytes` (or that break a layout rule).

    Likeliest fastest first, for every model: the least model parallelism of the LLM (tp *
    pp: fewer collectives on the critical path, no bubble), then the lesser tp, then the
    least static memory (ZeRO-3 before ZeRO-1; a non-colocated encoder's share), then the
    smallest micro-batch. A candidate that does not fit rules out the ones after it that
    need as much (search's `outgrown`)."""
    feasible, dropped = [], []
    for kind, layout, mb in found:
        try:
            need = static_bytes(request.tensors, layout)
        except LayoutError as exc:
            dropped.append(Candidate(kind, layout, mb, 0).dropped(str(exc)))
            continue
        candidate = Candidate(kind, layout, mb, need)
        if need > capacity_bytes:
            dropped.append(candidate.dropped(f"static state {need / 2**30:.1f} GiB > {capacity_bytes / 2**30:.1f} GiB"))
        else:
            feasible.append(candidate)
    feasible.sort(key=lambda c: (c.tp_pp[0] * c.tp_pp[1], c.tp_pp[0], c.need, c.micro_batch))
    return feasible, dropped


def top_fitting(results: list[dict], top: int) -> list[dict]:
    """The `top` fastest (tokens/s) of emulate() results that fit in memory (the compare
    page's "top K from search" keeps the same ones: frontend compare-store.js searchTop)."""
    fitting = [r for r in results if r.get("memory", {}).get("fits")]
    return sorted(fitting, key=lambda r: -r["tokens_per_second"])[:top]


KINDS = ("homogeneous", "colocated", "non-colocated")
ENCODER_SHARES = (32, 16, 8, 4)  # non-colocated: the encoder gets N / share GPUs


def _llm_layouts(request: SearchRequest, gpus: int) -> list[tuple[str, int]]:
    zero = tuple(z for z in request.zero if z <= 2) or (1,)
    return candidate_layouts(replace(request, gpus=gpus, zero=zero))


def _encoder_tps(heads: int, gpus: int, gpus_per_node: int, choices=(1, 2)) -> list[int]:
    return [tp for tp in choices if heads % tp == 0 and gpus % tp == 0 and tp <= gpus_per_node]


def tp_pp(layout: str) -> tuple[int, int]:
    """(tp, pp) of a layout's last module (the LLM of a multimodal layout)."""
    fields = {k: int(v) for k, v in (p.split("=") for p in layout.split(";")[-1].split(":")[-1].split(",")
                                     if not p.startswith("ranks"))}
    return fields.get("tp", 1), fields.get("pp", 1)


def multimodal_candidates(request, *, encoder_tp=(1, 2), shares=ENCODER_SHARES, llm_tp: tuple[int, ...] | None = None,
                          llm_pp: tuple[int, ...] | None = None) -> list[tuple[str, str, int]]:
    """(placement kind, layout, micro-batch size) for a multimodal model on request.gpus GPUs;
    `llm_tp` / `llm_pp` keep only LLM layouts with those tp / pp (a benchmark's narrower sweep)."""
    n, gpn, heads = request.gpus, request.gpus_per_node, request.model_config.encoder.heads

    def llm_layouts(gpus: int):
        return [(layout, mb) for layout, mb in _llm_layouts(request, gpus)
                if (llm_tp is None or tp_pp(layout)[0] in llm_tp) and (llm_pp is None or tp_pp(layout)[1] in llm_pp)]

    out = []
    for layout, mb in llm_layouts(n):
        tp, pp = tp_pp(layout)
        if pp == 1 and heads % tp == 0:
            out.append(("homogeneous", layout, mb))
        for etp in _encoder_tps(heads, n, gpn, encoder_tp):
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
