"""`dynaplane models` and `dynaplane plan` (docs/contracts.md section 3): the pure layout core
from the command line. Imports only parallelism.layout (no torch, no Django)."""
from __future__ import annotations

import argparse
import json
import sys


def add_commands(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("models", help="list the model catalog with parameter counts")
    m.add_argument("--json", action="store_true", help="print the catalog as JSON")
    m.set_defaults(func=run_models)

    p = sub.add_parser("plan", help="plan a layout switch (routing plan, rounds, memory, time)")
    p.add_argument("--model", required=True, help="catalog name (see `dynaplane models`) or path to a config.json")
    p.add_argument("--from", dest="src", required=True, help="source layout, e.g. tp=8,pp=4,dp=4,zero=1")
    p.add_argument("--to", dest="dst", required=True, help="destination layout")
    p.add_argument("--gpus-per-node", type=int, default=8,
                   help="GPUs per node of the cluster the plan is for (default 8)")
    p.add_argument("--staging-mb", type=float, default=256.0, help="per-rank staging budget per round (MiB)")
    p.add_argument("--intra-gbps", type=float, default=None, help="same-node GB/s per GPU (default 150)")
    p.add_argument("--inter-gbps", type=float, default=None, help="cross-node GB/s per GPU (default 25 = 200 Gb/s)")
    p.add_argument("--keep-rank-order", action="store_true",
                   help="give destination rank d to the GPU of source rank d (the contract's order) instead of "
                        "the device-to-rank map that moves the fewest bytes")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--dump", metavar="FILE",
                   help="write every shard, transfer, local copy and derived box (small cases)")
    p.set_defaults(func=run_plan)


def run_models(args: argparse.Namespace) -> int:
    from parallelism.layout.catalog import catalog_names, get_model, model_summary

    rows = [model_summary(get_model(name)) for name in catalog_names()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"{'model':24} {'params':>10} {'layers':>14} {'hidden':>7} {'heads':>6} {'kv':>4} {'experts':>8}")
    for r in rows:
        layers = "+".join(str(n) for n in r["layers"].values())
        params = f"{r['params'] / 1e9:.3f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.3f}M"
        print(f"{r['name']:24} {params:>10} {layers:>14} {r['hidden']:>7} {r['heads']:>6} "
              f"{r['kv_heads']:>4} {r['experts'] or '-':>8}")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def run_plan(args: argparse.Namespace) -> int:
    from parallelism.layout.catalog import get_model
    from parallelism.layout.errors import LayoutError
    from parallelism.planner.estimate import Network
    from parallelism.planner.plan import PlanOptions, plan_routes

    try:
        network = Network(**{k: v for k, v in (("intra_gbytes_per_s", args.intra_gbps),
                                                ("inter_gbytes_per_s", args.inter_gbps)) if v is not None})
        options = PlanOptions(gpus_per_node=args.gpus_per_node, staging_bytes=int(args.staging_mb * 2**20),
                              network=network, map_ranks=not args.keep_rank_order)
        model = get_model(args.model)
        plan = plan_routes(model, args.src, args.dst, options)
        summary = plan.summary()
    except (LayoutError, ValueError) as exc:
        print(f"dynaplane plan: {exc}", file=sys.stderr)
        return 2
    if args.dump:
        if summary["transfers"] > 200_000:
            print(f"dynaplane plan: --dump refused: {summary['transfers']} transfers is too many for a JSON file "
                  f"(the dump is meant for small cases)", file=sys.stderr)
            return 2
        with open(args.dump, "w") as handle:
            json.dump(plan.dump(), handle)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    s = summary
    print(f"{s['model']}: {s['src']} ({s['world_src']} ranks) -> {s['dst']} ({s['world_dst']} ranks)")
    print(f"  destination state {_human(s['state_bytes_dst'])}: local {_human(s['local_bytes'])}, "
          f"derived {_human(s['derived_bytes'])}, network {_human(s['network_bytes'])} "
          f"(minimum {_human(s['min_network_bytes'])}; checkpoint-restart moves {_human(s['checkpoint_bytes'])})")
    if s["ranks_renumbered"]:
        print(f"  device map: {s['ranks_renumbered']} of {s['world_dst']} destination ranks on another GPU than "
              f"their number; the contract's rank order would move {_human(s['contract_order_network_bytes'])}")
    print(f"  {s['transfers']} transfers in {s['rounds']} rounds; per rank at most {_human(s['max_rank_send_bytes'])} "
          f"sent, {_human(s['max_rank_recv_bytes'])} received, {_human(s['peak_staging_bytes'])} staged "
          f"(budget {_human(s['staging_budget_bytes'])})")
    print(f"  predicted peak state per rank {_human(s['predicted_peak_bytes'])}; estimated switch "
          f"{s['estimated_seconds']:.3f} s; planned in {s['plan_seconds']:.3f} s")
    print(f"  fingerprint {s['fingerprint']}")
    return 0
