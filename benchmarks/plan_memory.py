"""Predicted memory wave against the bound max(source, destination) + staging, per rank,
and against that bound + the largest box the rank frees or allocates (whole boxes cannot
promise less, docs/planner.md): the headline plans of plan_scaling.py, then more
pipeline changes.

    .venv/bin/python -m benchmarks.plan_memory
"""
from __future__ import annotations

import numpy as np

from parallelism.layout.catalog import get_model
from parallelism.planner.plan import plan_routes
from benchmarks.plan_scaling import HEADLINE

MORE = [
    ("llama3-70b", "tp=8,pp=4,dp=2,zero=1", "tp=8,pp=2,dp=4,zero=1"),
    ("llama3-70b", "tp=8,pp=8,zero=1", "tp=4,pp=10,zero=1"),
    ("llama3-405b", "tp=8,pp=8,dp=2,zero=1", "tp=8,pp=16,zero=1"),
    ("qwen3-235b-a22b", "tp=4,pp=8,dp=8,ep=8,zero=1", "tp=4,pp=6,dp=8,ep=4,zero=1"),
    ("llama3-8b", "tp=2,pp=4,vpp=2,dp=2,zero=1", "tp=4,pp=2,dp=2,zero=3"),
    ("gpt3-175b", "tp=8,pp=12,dp=2,zero=1", "tp=8,pp=8,dp=3,zero=1"),
]


def main() -> None:
    print("| model | from -> to | max peak / bound | ranks over | ranks over bound + box | most boxes over bound "
          "| max peak GiB | max(src, dst) GiB | rounds | est. switch s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, src, dst in HEADLINE + MORE:
        plan = plan_routes(get_model(model), src, dst)
        after, peak = plan.waves
        bound = np.maximum(after[0], after[-1]) + plan.options.staging_bytes
        rank_peak = peak.max(axis=0)
        ratio = rank_peak / bound
        boxes_over = ((rank_peak - bound) / np.maximum(plan.largest_boxes, 1)).max()
        summary = plan.summary()
        print(f"| {model} | `{src}` -> `{dst}` | {ratio.max():.3f} | {int((ratio > 1).sum())} of {plan.world} | "
              f"{summary['ranks_over_box_bound']} | {max(boxes_over, 0):.2f} | {peak.max() / 2**30:.1f} | "
              f"{np.maximum(after[0], after[-1]).max() / 2**30:.1f} | {summary['rounds']} | "
              f"{summary['estimated_seconds']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
