"""Predicted memory wave against the bound max(source, destination) + staging, per rank,
for the headline plans of plan_scaling.py.

    .venv/bin/python benchmarks/plan_memory.py
"""
from __future__ import annotations

import numpy as np

from agents.layout.catalog import get_model
from agents.layout.plan import plan_routes
from benchmarks.plan_scaling import HEADLINE


def main() -> None:
    print("| model | from -> to | max peak / bound | ranks over | max peak GiB | max(src, dst) GiB |")
    print("|---|---|---|---|---|---|")
    for model, src, dst in HEADLINE:
        plan = plan_routes(get_model(model), src, dst)
        after, peak = plan.waves
        bound = np.maximum(after[0], after[-1]) + plan.options.staging_bytes
        ratio = peak.max(axis=0) / bound
        print(f"| {model} | `{src}` -> `{dst}` | {ratio.max():.3f} | {int((ratio > 1).sum())} of {plan.world} | "
              f"{peak.max() / 2**30:.1f} | {np.maximum(after[0], after[-1]).max() / 2**30:.1f} |")


if __name__ == "__main__":
    main()
