"""Elastic scheduler benchmark (issue 31): a synthetic day of arrivals and departures
(benchmarks/elastic_trace.py) replayed through the pure scheduler
(parallelism/layout/elastic_policy.decide) on a simulated cluster, three ways:

- static: every job runs on the GPUs it asked for until it ends (queued by priority);
- restart: the elastic policy, each resize costing a stop-checkpoint-restart pause
  (elastic_inputs.RestartPause: 41.8 s grow / 21.1 s shrink measured for llama-124m,
  scaled by the model state per GPU over llama-124m's 1.74 GB);
- online: the elastic policy, each resize costing the online switch's pause
  (elastic_inputs.OnlinePause: 0.22 s + the state a joining GPU receives at 1.2 GB/s).
The policy's payoff test uses the same cost model as the replay, so restart elasticity
also grows less. A job trains at its predicted step time except while paused; the GPUs it
holds during a pause count as allocated but not useful. Utilisation = useful GPU-seconds /
(GPUs x the day). Starting a job costs nothing in any mode.

    .venv/bin/python -m benchmarks.elastic_scheduler                # 1,024 GPUs, one day
    .venv/bin/python -m benchmarks.elastic_scheduler --nodes 8 --hours 6 --json
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass

from parallelism.layout.elastic_inputs import ElasticJob, ElasticSettings, Node, OnlinePause, RestartPause
from parallelism.layout.elastic_policy import decide
from benchmarks.elastic_trace import HOUR, Arrival, day_trace

MODES = ("static", "restart", "online")


@dataclass
class Running:
    arrival: Arrival
    id: int
    steps_left: float
    holding: tuple[str, ...] = ()
    paused_until: float = 0.0
    last_resize_at: float | None = None
    started_at: float | None = None

    def step_seconds(self) -> float:
        return next(o.step_seconds for o in self.arrival.options if o.gpus == len(self.holding))

    def done_at(self, now: float) -> float:
        return max(now, self.paused_until) + self.steps_left * self.step_seconds()


def as_job(r: Running, mode: str, now: float) -> ElasticJob:
    t = r.arrival.template
    elastic = t.elastic and mode != "static"
    gpus = len(r.holding) or t.gpus
    return ElasticJob(
        id=r.id, name=r.arrival.name, gpus=gpus, priority=t.priority, elastic=elastic,
        min_gpus=t.min_gpus if elastic else gpus, max_gpus=t.max_gpus if elastic else gpus, holding=r.holding,
        options=r.arrival.options, busy=r.paused_until > now,
        step_seconds=r.step_seconds() if r.holding else None, remaining_steps=math.ceil(r.steps_left),
        last_resize_at=r.last_resize_at)


def replay(arrivals: list[Arrival], *, nodes: int, per_node: int, hours: float, mode: str, tick: float = 120.0,
           settings: ElasticSettings | None = None) -> dict:
    settings = settings or ElasticSettings(pause=RestartPause() if mode == "restart" else OnlinePause())
    cluster = [Node(f"node-{i + 1}", per_node) for i in range(nodes)]
    end = hours * HOUR
    queue = list(arrivals)
    jobs: dict[int, Running] = {}
    useful = allocated = paused = 0.0
    resizes = 0
    waits: list[float] = []
    finished = 0
    decide_seconds: list[float] = []
    now = 0.0
    next_id = 0
    while now < end:
        running = [r for r in jobs.values() if r.holding]
        upcoming = [queue[0].at if queue else end, end, (math.floor(now / tick) + 1) * tick,
                    *(r.done_at(now) for r in running)]
        nxt = min(end, max(now, min(upcoming)))
        for r in running:
            gpus = len(r.holding)
            trained = max(0.0, nxt - max(now, r.paused_until))
            r.steps_left -= trained / r.step_seconds()
            useful += gpus * trained
            allocated += gpus * (nxt - now)
            paused += gpus * (nxt - now - trained)
        now = nxt
        for r in [r for r in running if r.steps_left <= 1e-6]:
            finished += 1
            del jobs[r.id]
        while queue and queue[0].at <= now:
            a = queue.pop(0)
            next_id += 1
            jobs[next_id] = Running(a, next_id, float(a.steps))
        if now >= end:
            break
        started = time.perf_counter()
        decision = decide(cluster, [as_job(r, mode, now) for r in jobs.values()], settings, now)
        decide_seconds.append(time.perf_counter() - started)
        for change in decision.changes:
            r = jobs[change.job_id]
            if change.kind == "start":
                r.started_at = now
                if r.arrival.template.priority >= 10:
                    waits.append(now - r.arrival.at)
            else:
                resizes += 1
                option = next(o for o in r.arrival.options if o.gpus == change.gpus_to)
                r.paused_until = now + settings.pause.pause_seconds(as_job(r, mode, now), option)
            r.holding = change.holding
            r.last_resize_at = now
    total = nodes * per_node * end
    return {"mode": mode, "gpus": nodes * per_node, "hours": hours, "jobs": len(arrivals), "finished": finished,
            "utilisation": useful / total, "allocated": allocated / total, "paused_gpu_hours": paused / HOUR,
            "resizes": resizes, "resizes_per_hour": resizes / hours,
            "priority_jobs_started": len(waits), "priority_wait_mean_s": sum(waits) / len(waits) if waits else None,
            "priority_wait_max_s": max(waits) if waits else None, "decisions": len(decide_seconds),
            "decide_ms_mean": 1000 * sum(decide_seconds) / max(len(decide_seconds), 1),
            "decide_ms_max": 1000 * max(decide_seconds, default=0.0)}


def table(results: list[dict]) -> str:
    rows = ["| mode | GPU utilisation | allocated | paused GPU-h | resizes | resizes/h | priority wait mean / max "
            "| jobs finished | decide() mean / max |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        wait = "-" if r["priority_wait_mean_s"] is None else \
            f"{r['priority_wait_mean_s']:.0f} s / {r['priority_wait_max_s']:.0f} s"
        rows.append(f"| {r['mode']} | {100 * r['utilisation']:.1f}% | {100 * r['allocated']:.1f}% | "
                    f"{r['paused_gpu_hours']:.1f} | {r['resizes']} | {r['resizes_per_hour']:.1f} | {wait} | "
                    f"{r['finished']}/{r['jobs']} | {r['decide_ms_mean']:.1f} / {r['decide_ms_max']:.0f} ms |")
    return "\n".join(rows)


def ratios(results: list[dict]) -> dict:
    by = {r["mode"]: r for r in results}
    online = by["online"]["utilisation"]
    return {"online_vs_static": online / by["static"]["utilisation"],
            "online_vs_restart": online / by["restart"]["utilisation"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=31)
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    arrivals = day_trace(args.seed, nodes=args.nodes, per_node=args.gpus_per_node, hours=args.hours)
    results = [replay(arrivals, nodes=args.nodes, per_node=args.gpus_per_node, hours=args.hours, mode=m) for m in MODES]
    if args.json:
        print(json.dumps({"seed": args.seed, "results": results, "ratios": ratios(results)}, indent=2))
        return
    print(f"{args.nodes} nodes x {args.gpus_per_node} GPUs, {args.hours:g} h, seed {args.seed}, "
          f"{len(arrivals)} jobs\n")
    print(table(results))
    print("\n" + ", ".join(f"{k.replace('_', ' ')}: {v:.2f}x" for k, v in ratios(results).items()))


if __name__ == "__main__":
    main()
