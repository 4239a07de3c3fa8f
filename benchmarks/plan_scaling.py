"""Planner benchmark (issue 3): plan time and planner memory at scale, network bytes
against checkpoint-restart, estimated switch time. Prints a markdown table.

    .venv/bin/python -m benchmarks.plan_scaling            # all cases (~1 min)
    .venv/bin/python -m benchmarks.plan_scaling --quick    # the two headline cases
"""
from __future__ import annotations

import argparse
import gc
import time
import tracemalloc

from parallelism.layout.catalog import get_model
from parallelism.planner.plan import PlanOptions, plan_routes

HEADLINE = [
    ("llama3-405b", "tp=8,pp=16,dp=64,zero=1", "tp=8,pp=16,dp=48,zero=1"),
    ("qwen3-235b-a22b", "tp=4,pp=8,dp=32,ep=8,zero=1", "tp=4,pp=8,dp=24,ep=8,zero=1"),
    ("llama3-70b", "tp=8,pp=4,dp=4,zero=1", "tp=8,pp=4,dp=3,zero=1"),
    ("llama3-405b", "tp=8,pp=16,dp=1,zero=1", "tp=8,pp=12,dp=1,zero=1"),
]


def measure(model_name: str, src: str, dst: str) -> dict:
    """Times from an untraced run; planner memory from a second run under tracemalloc
    (which slows numpy-heavy code down, so it is not timed)."""
    model = get_model(model_name)
    gc.collect()
    started = time.perf_counter()
    plan = plan_routes(model, src, dst, PlanOptions())
    planned = time.perf_counter() - started
    summary = plan.summary()
    total = time.perf_counter() - started
    del plan
    gc.collect()
    tracemalloc.start()
    plan_routes(model, src, dst, PlanOptions()).summary()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"model": model_name, "src": src, "dst": dst, "plan_s": planned, "plan_and_stats_s": total,
            "planner_peak_mib": peak / 2**20, **summary}


def gib(n: float) -> str:
    return f"{n / 2**30:,.0f}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    cases = HEADLINE[:2] if args.quick else HEADLINE
    print("| model | from -> to | ranks | plan s | plan+stats s | planner peak MiB | network GiB | checkpoint GiB "
          "| ckpt / network | rounds | transfers | est. switch s | ranks over mem bound |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        r = measure(*case)
        print(f"| {r['model']} | `{r['src']}` -> `{r['dst']}` | {r['world_src']} -> {r['world_dst']} | "
              f"{r['plan_s']:.2f} | {r['plan_and_stats_s']:.2f} | {r['planner_peak_mib']:.0f} | {gib(r['network_bytes'])} | "
              f"{gib(r['checkpoint_bytes'])} | {r['checkpoint_bytes'] / max(r['network_bytes'], 1):.2f} | {r['rounds']} | "
              f"{r['transfers']:,} | {r['estimated_seconds']:.2f} | {r['ranks_over_memory_bound']} |")
    if args.quick:
        return
    print()
    print("Plan time against world size: llama3-405b, a quarter of the pipeline stages removed "
          "(`tp=8,pp=16,dp=D,zero=1` -> `tp=8,pp=12,dp=D,zero=1`).")
    print()
    print("| ranks | plan s | plan+stats s | planner peak MiB | transfers | rounds |")
    print("|---|---|---|---|---|---|")
    for dp in (1, 2, 4, 8, 16, 32, 64, 128):
        r = measure("llama3-405b", f"tp=8,pp=16,dp={dp},zero=1", f"tp=8,pp=12,dp={dp},zero=1")
        print(f"| {r['world_src']} -> {r['world_dst']} | {r['plan_s']:.2f} | {r['plan_and_stats_s']:.2f} | "
              f"{r['planner_peak_mib']:.0f} | {r['transfers']:,} | {r['rounds']} |", flush=True)


if __name__ == "__main__":
    main()
