"""How long an emulation takes through the product (issue 12): the compare page's "compare 3
configurations" and "top 3 from search", timed from the request to the last result, on a
stack started here (embedded defaults, 2 agents x 2 virtual GPUs), and where the time goes.

Each run reports, from the control plane's records: `queued` (created -> the agent starts:
the emulate queue and the agent's threads), `agent` (the agent's wall_seconds: torch import
on a cold agent, tracing in fresh processes, simulation), `trace` (the trace's share),
and `total` (request -> last run done, as the page waits). Rounds: cold (a fresh stack),
warm (the same configurations again: traces cached), warm-new (other configurations: a
warm agent, new traces).

    flock /tmp/dynaplane-stack.lock .venv/bin/python -m benchmarks.emulation_latency [--json F]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from tests.support.stack import StackProcess, wait_for

SETTING = {"model": "tiny-gpt", "gpus": 4, "gpu_type": "h100", "global_batch": 8, "micro_batch": 2, "seq_len": 64}
FIRST = ["tp=2,pp=2,dp=1", "pp=2,dp=2", "tp=2,dp=2"]
OTHER = ["pp=4,dp=1", "tp=1,pp=1,dp=4,zero=3", "tp=2,pp=2,dp=1,zero=0"]


def _runs(stack: StackProcess, ids: list[int], timeout: float) -> list[dict]:
    def done():
        runs = [stack.get(f"api/emulations/{i}", token=True) for i in ids]
        return runs if all(r["state"] in ("done", "failed") for r in runs) else None

    runs, _ = wait_for(done, timeout, interval=0.2)
    return runs


def _when(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def compare_round(stack: StackProcess, layouts: list[str], timeout: float = 600) -> dict:
    started = time.time()
    body = stack.post("api/emulations", {"configs": [{**SETTING, "layout": layout} for layout in layouts]})
    runs = _runs(stack, [r["id"] for r in body["runs"]], timeout)
    ended = max(_when(r["finished_at"]) for r in runs)
    rows = [{"layout": r["layout"], "state": r["state"], "agent": r["wall_seconds"],
             "queued": _when(r["finished_at"]) - _when(r["created_at"]) - (r["wall_seconds"] or 0),
             "trace": (r["result"] or {}).get("trace_seconds"),
             "cached": (r["result"] or {}).get("trace_cached")} for r in runs]
    return {"total": ended - started, "runs": rows}


def search_round(stack: StackProcess, top: int = 3, timeout: float = 900) -> dict:
    """The page's "top K from search": rank on an agent, emulate the first 3 x K as one compare."""
    started = time.time()
    run = stack.post("api/emulations/search", {**SETTING, "top": top})
    (ranked,) = _runs(stack, [run["id"]], timeout)
    ranking = time.time() - started
    compared = compare_round(stack, ranked["result"]["layouts"], timeout)
    return {"total": time.time() - started, "ranking": ranking, "compare": compared}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the figures to this file too")
    args = parser.parse_args(argv)
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        stack = StackProcess(Path(tmp), agents=2, gpus_per_agent=2, env={"DATABASE_URL": None, "REDIS_URL": None})
        stack.start()
        try:
            out["ready_seconds"] = stack.wait_ready(timeout=180)
            out["cold"] = compare_round(stack, FIRST)
            out["warm"] = compare_round(stack, FIRST)
            out["warm_new"] = compare_round(stack, OTHER)
            out["search_top3"] = search_round(stack)
        finally:
            stack.stop()
    for name in ("cold", "warm", "warm_new"):
        r = out[name]
        print(f"compare 3 ({name}): {r['total']:.1f} s; per run " + "; ".join(
            f"{x['layout']}: queued {x['queued']:.1f} s, agent {x['agent'] or 0:.1f} s (trace "
            f"{x['trace'] or 0:.1f} s{', cached' if x['cached'] else ''})" for x in r["runs"]))
    s = out["search_top3"]
    print(f"top 3 from search: {s['total']:.1f} s (ranking {s['ranking']:.1f} s, compare of "
          f"{len(s['compare']['runs'])} {s['compare']['total']:.1f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
