"""Heterogeneous parallelism for multimodal models, emulated on H100 (issue 8's benchmark).

    .venv/bin/python -m benchmarks.hetero_emulated [--scales 256,1024] [--max-candidates 6] [MODEL ...]

MODEL: internvit300m-llama3-8b, internvit6b-llama3-70b (default: both).

For each model at 256 and 1,024 H100s (8 per node): `search` (search.search)
over homogeneous, colocated and non-colocated candidates, narrowed to keep the tracing
affordable on a 2-core machine: LLM tp 4 or 8, pp 1 (8B) or 4 (70B), micro-batch 1,
zero=1, the encoder at tp=1 when colocated and on N/16 GPUs when non-colocated, at most
MAX_CANDIDATES emulated (split evenly over the three placements). Each sample is one
448 px image (1,025 image tokens: 1,024 patches + the class token, no pixel shuffle) and
3,072 text tokens, so the LLM runs 4,097 positions; the global batch is 3.75 samples per
GPU (960 at 256 GPUs, 3,840 at 1,024: divisible by every LLM dp of the candidates).
Recompute: full (the eager program's activations of a whole layer do not fit otherwise).
Prints the best layout of each placement (tokens/s counts text tokens; model TFLOP/s per
GPU counts the encoder's FLOPs too) and the gains against the best homogeneous one, next to
the paper's reported gains, then the JSON of every emulated candidate.
"""
from __future__ import annotations

import json
import sys
import time

SEQ, IMAGES_PER_SAMPLE = 3072, 1
BATCH_PER_GPU = 3.75
SCALES = (256, 1024)
MAX_CANDIDATES = 6
# pp=1 for the 8B LLM (it fits; every candidate's LLM is then one traced class), pp=4 for the 70B
LLM_PP = {"internvit300m-llama3-8b": (1,), "internvit6b-llama3-70b": (4,)}
PAPER = {"colocated": "up to +49.3% TFLOP/s per GPU", "non-colocated": "up to +13.0% tokens/s, +9.6% TFLOP/s per GPU"}


def run(model: str, gpus: int, max_candidates: int) -> dict:
    from parallelism.emulator.search import SearchRequest, search

    request = SearchRequest(model, gpus=gpus, gpu="h100", global_batch=int(BATCH_PER_GPU * gpus), seq=SEQ,
                            top=10, recompute="full", micro_batches=(1,), zero=(1,), max_candidates=max_candidates)
    started = time.perf_counter()
    result = search(request, progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
                               encoder_tp=(1,), shares=(16,), llm_tp=(4, 8), llm_pp=LLM_PP[model])
    result["wall_seconds"] = time.perf_counter() - started
    return result


def row(model: str, gpus: int, kind: str, r: dict | None, base: dict | None, base_kind: str = "homogeneous") -> str:
    """`base`: the best homogeneous layout, or (where none exists or fits, e.g. InternViT-6B's 25
    heads leave only tp=1) the best colocated one, named in the gain."""
    if r is None:
        return f"| {model} | {gpus} | {kind} | none emulated fits | | | | | |"
    gain = ""
    if base is not None and r is not base:
        gain = (f"{r['model_tflops_per_gpu'] / base['model_tflops_per_gpu'] - 1:+.1%} TFLOP/s, "
                f"{r['tokens_per_second'] / base['tokens_per_second'] - 1:+.1%} tokens/s"
                + ("" if base_kind == "homogeneous" else f" (vs {base_kind})"))
    return (f"| {model} | {gpus} | {kind} | `{r['layout']}` | {r['step_seconds']:.2f} | {r['tokens_per_second']:,.0f} | "
            f"{r['model_tflops_per_gpu']:.0f} | {r['memory']['peak_bytes'] / 2**30:.0f} | {gain} |")


def main(models: list[str], scales=SCALES, max_candidates: int = MAX_CANDIDATES) -> None:
    results = []
    print("| model | GPUs | placement | best layout | step s | text tokens/s | model TFLOP/s/GPU | peak GiB | "
          "vs best homogeneous |")
    print("|---|---|---|---|---|---|---|---|---|")
    for model in models:
        for gpus in scales:
            result = run(model, gpus, max_candidates)
            results.append(result)
            best = result["best_by_placement"]
            base_kind = "homogeneous" if best["homogeneous"] is not None else "colocated"
            for kind in ("homogeneous", "colocated", "non-colocated"):
                print(row(model, gpus, kind, best[kind], best[base_kind], base_kind), flush=True)
            print(f"<!-- {model} at {gpus}: {result['candidates']} candidates, {result['emulated']} emulated in "
                  f"{result['wall_seconds']:.0f} s -->", flush=True)
    print("\npaper (arXiv 2605.27678): " + "; ".join(f"{k} {v}" for k, v in PAPER.items()))
    print(json.dumps(results, indent=1, default=str), file=sys.stderr)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("models", nargs="*", default=["internvit300m-llama3-8b", "internvit6b-llama3-70b"])
    parser.add_argument("--scales", default=",".join(map(str, SCALES)))
    parser.add_argument("--max-candidates", type=int, default=MAX_CANDIDATES)
    args = parser.parse_args()
    main(args.models, tuple(int(x) for x in args.scales.split(",")), args.max_candidates)
