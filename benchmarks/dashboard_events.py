"""Dashboard under load: 64 nodes x 8 GPUs, 10 running jobs each reporting 10 steps/s.

A real stack (`dynaplane up`, no real agents: daphne + Channels on channels-redis, the
control-plane Celery worker, PostgreSQL or SQLite) and a real browser (Playwright driving
Debian's Chromium). The agents are simulated at the message level: this process sends the
messages real agents send, through the real path

    Celery send_task (queue "control") -> control-plane worker (heartbeat / job report
    tasks, DB writes, seq) -> channels-redis group_send -> daphne websocket -> browser

64 nodes heartbeat every 2 s (AgentHeartbeat, 8 virtual GPUs each, posted to Redis as agents
post them: agents/liveness.py); 10 jobs (dp=8) are
created and started through the API and moved to running by a `started` JobReport; then
every job sends `step` JobReports: one phase at 1/s per job, then one at 10/s per job
(the issue's load), each drained before the next. Each job's reports go through the
ReportBatcher rank 0 uses (agents/runtime/batching.py: control.ingest_events batches,
`--window` s; 0 sends every report alone). The browser has the cluster dashboard open
and follows the 10 jobs' streams (/ws/jobs/<id>/, what a job page subscribes to).

Measured: page load (navigation to load event, and to the grid showing all 512 GPUs
live), latency from rank 0 making the report (before its batching window) to the
browser's websocket onmessage (same machine clock: Python time.time() vs the page's
Date.now()), p50/p95/max, and per job that the seqs are 1..n with no gap and the steps
arrive in the order they were sent.

    flock /tmp/dynaplane-stack.lock .venv/bin/python -m benchmarks.dashboard_events --seconds 30
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from celery import Celery

from agents import protocol
from agents.liveness import HeartbeatPoster
from agents.node.inventory import virtual_gpus
from agents.runtime.batching import DEFAULT_WINDOW_SECONDS
from agents.seal import AgentKey, key_of_token, seal
from tests.support.simulated_agents import RankZeros

NODES, GPUS_PER_NODE, JOBS = 64, 8, 10
CHROMIUM = os.environ.get("DYNAPLANE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"]

# Injected into the dashboard: follow each job's stream, keep what arrived and when.
FOLLOW_JOBS = """(ids) => new Promise((resolve) => {
  window.__bench = {};
  let open = 0;
  for (const id of ids) {
    const got = window.__bench[id] = [];
    const ws = new WebSocket(`ws://${location.host}/ws/jobs/${id}/`);
    ws.onmessage = (m) => { const now = Date.now(); const e = JSON.parse(m.data);
      if (e.type === "metrics") got.push([e.seq, e.step, now]); };
    ws.onopen = () => { if (++open === ids.length) resolve(open); };
  }
})"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class SimulatedAgents:
    """64 agents' heartbeats, every 2 s, in a background thread, posted as agents post them
    (agents/liveness.py); each sealed with the key of the token issued for its node (agents/seal.py)."""

    def __init__(self, redis_url: str, keys: dict[str, AgentKey]) -> None:
        self.poster, self.keys, self.stop = HeartbeatPoster(redis_url), keys, threading.Event()
        self.started = datetime.now(timezone.utc)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def beat_once(self) -> None:
        now = datetime.now(timezone.utc)
        for n in range(1, NODES + 1):
            node = f"node-{n:02d}"
            beat = protocol.AgentHeartbeat(node=node, host=f"sim-{n:02d}", device="cpu", pid=1000 + n,
                                           started_at=self.started, sent_at=now,
                                           interval_seconds=protocol.HEARTBEAT_SECONDS,
                                           gpus=virtual_gpus(GPUS_PER_NODE, memory_bytes=80 * 2**30)).model_dump(mode="json")
            self.poster.post(node, beat, seal(self.keys[node], node, protocol.CONTROL_AGENT_HEARTBEAT, beat))

    def _run(self) -> None:
        while not self.stop.wait(protocol.HEARTBEAT_SECONDS):
            self.beat_once()


def send_steps(report: RankZeros, job_ids: list[int], seconds: float, rate: float,
               first_step: int) -> dict[tuple[int, int], float]:
    """Every job one step report every 1/rate s, spread evenly, steps from `first_step`;
    (job, step) -> the time rank 0 made it (ms since the epoch)."""
    sent: dict[tuple[int, int], float] = {}
    interval = 1.0 / (rate * len(job_ids))
    start = time.perf_counter()
    total = int(seconds * rate) * len(job_ids)
    for n in range(total):
        delay = start + n * interval - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        job = job_ids[n % len(job_ids)]
        step = first_step + n // len(job_ids)
        sent[(job, step)] = time.time() * 1000
        report(job, "step", step=step, loss=1.0 / step, step_seconds=0.1, tokens_per_second=1000.0)
    return sent


def drain(page, expected: int, *, stall_seconds: float = 20.0, limit_seconds: float = 400.0) -> None:
    """Wait until the browser has `expected` events, or none arrived for `stall_seconds`."""
    count = "Object.values(window.__bench).reduce((n, got) => n + got.length, 0)"
    last, last_change, start = -1, time.monotonic(), time.monotonic()
    while time.monotonic() - start < limit_seconds:
        now = page.evaluate(count)
        if now >= expected:
            return
        if now != last:
            last, last_change = now, time.monotonic()
        elif time.monotonic() - last_change > stall_seconds:
            return
        time.sleep(0.5)


def summarize(got: dict, sent: dict[tuple[int, int], float], job_ids: list[int], seconds: float, rate: float) -> dict:
    latencies, lost, arrivals = [], 0, []
    for job_id in job_ids:
        rows = [r for r in got.get(str(job_id), []) if (job_id, r[1]) in sent]
        lost += sum(1 for (j, _) in sent if j == job_id) - len({r[1] for r in rows})
        latencies += [t - sent[(job_id, step)] for _, step, t in rows]
        arrivals += [t for _, _, t in rows]
    span = (max(arrivals) - min(sent.values())) / 1000 if arrivals else 0.0
    return {"events_per_second_per_job": rate, "seconds": seconds, "events_sent": len(sent),
            "events_received": len(latencies), "lost": lost,
            "delivered_per_second": round(len(latencies) / span, 1) if span else None,
            "latency_ms": {"p50": round(percentile(latencies, 50)), "p95": round(percentile(latencies, 95)),
                           "p99": round(percentile(latencies, 99)), "max": round(max(latencies))}
            if latencies else None}


def run(seconds: float, rates: list[float], out_dir: Path, window: float) -> dict:
    from playwright.sync_api import sync_playwright

    from tests.support.stack import StackProcess, isolated_database, wait_for

    redis_url = os.environ.get("REDIS_URL")
    env = {"REDIS_URL": redis_url.rsplit("/", 1)[0] + "/7"} if redis_url else {}
    if env:  # the benchmark's own Redis database: a previous run's backlog must not leak in
        import redis

        redis.Redis.from_url(env["REDIS_URL"]).flushdb()
    with isolated_database() as database_url:
        stack = StackProcess(out_dir / "stack", agents=0, env={"DATABASE_URL": database_url, **env})
        stack.start()
        try:
            stack.wait_ready()
            return _measure(stack, seconds, rates, out_dir, window, sync_playwright, wait_for)
        finally:
            stack.stop()
            if env:
                redis.Redis.from_url(env["REDIS_URL"]).flushdb()


def _measure(stack, seconds: float, rates: list[float], out_dir: Path, window: float, sync_playwright,
             wait_for) -> dict:
    app = Celery("simulated-agents", broker=stack.state["redis_url"])
    app.conf.update(task_serializer="json", accept_content=["json"], task_ignore_result=True)
    keys = {f"node-{n:02d}": key_of_token(stack.post("api/agent-tokens", {"node": f"node-{n:02d}"})["token"])
            for n in range(1, NODES + 1)}
    agents = SimulatedAgents(stack.state["redis_url"], keys)
    agents.beat_once()
    agents.thread.start()
    wait_for(lambda: stack.get("api/health")["agents"]["healthy"] == NODES, timeout=60)
    job_ids = []
    for j in range(JOBS):
        job = stack.post("api/jobs", {"name": f"bench-{j}", "model": "tiny-gpt", "layout": "dp=8"})
        job_ids.append(job["id"])
    placed = {i: stack.get(f"api/jobs/{i}", token=True)["placement"] for i in job_ids}
    report = RankZeros(app, {i: slots[0]["node"] for i, slots in placed.items()}, keys, window)
    for job_id in job_ids:
        report(job_id, "started", step=0)
    wait_for(lambda: all(stack.get(f"api/jobs/{i}")["state"] == "running" for i in job_ids), timeout=60)

    result: dict = {"nodes": NODES, "gpus": NODES * GPUS_PER_NODE, "jobs": JOBS, "batch_window_seconds": window,
                    "load_average_before": os.getloadavg()}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS, headless=True)
        page = browser.new_page(viewport={"width": 1920, "height": 1080})
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(stack.url + "accounts/login/")
        page.get_by_label("Username").fill(stack.state["username"])
        page.get_by_label("Password").fill(stack.state["password"])
        page.get_by_role("button", name="Sign in").click()
        page.wait_for_selector("#cluster-grid", timeout=15_000)
        loads = []
        for _ in range(3):  # signed in: the dashboard itself, three times
            started = time.perf_counter()
            page.goto(stack.url)
            page.wait_for_function(f"document.querySelectorAll('[data-gpu]').length === {NODES * GPUS_PER_NODE}"
                                   " && document.querySelector('#connection').dataset.state === 'live'"
                                   " && document.querySelector('#gpu-state-chart .main-svg') !== null",
                                   timeout=30_000)
            shown = (time.perf_counter() - started) * 1000
            nav = page.evaluate("JSON.parse(JSON.stringify(performance.getEntriesByType('navigation')[0]))")
            loads.append({"load_event_ms": nav["loadEventEnd"], "dom_content_loaded_ms": nav["domContentLoadedEventEnd"],
                          "grid_live_ms": shown, "html_bytes": nav["transferSize"]})
        result["page_load"] = loads
        page.evaluate(FOLLOW_JOBS, job_ids)
        phases, sent_all, first = [], {}, 1
        for rate in rates:  # one phase per rate, each drained before the next
            sent = send_steps(report, job_ids, seconds, rate, first)
            first += int(seconds * rate)
            sent_all.update(sent)
            drain(page, len(sent_all))
            phases.append({**summarize(page.evaluate("window.__bench"), sent, job_ids, seconds, rate),
                           "load_average": os.getloadavg()})
        got = page.evaluate("window.__bench")
        page.screenshot(path=str(out_dir / "dashboard-64x8.png"), full_page=True)
        result["browser_errors"] = errors
        browser.close()
    agents.stop.set()
    report.close()

    reordered = seq_gaps = 0
    for job_id in job_ids:
        rows = got.get(str(job_id), [])
        seqs, steps = [r[0] for r in rows], [r[1] for r in rows]
        seq_gaps += sum(1 for a, b in zip(seqs, seqs[1:]) if b != a + 1)
        reordered += sum(1 for a, b in zip(steps, steps[1:]) if b < a)
    result.update({"phases": phases, "out_of_order": reordered, "seq_gaps": seq_gaps,
                   "lost": sum(p["lost"] for p in phases)})
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long each phase reports (default 20)")
    parser.add_argument("--rates", default="1,10", help="steps/s per job, one phase each (default 1,10)")
    parser.add_argument("--window", type=float, default=DEFAULT_WINDOW_SECONDS,
                        help=f"rank 0's report batching window in s (default {DEFAULT_WINDOW_SECONDS}; "
                             "0: one report per task)")
    parser.add_argument("--out", default="", help="folder for the stack's logs and the screenshot (default: a temp dir)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="dashboard-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    result = run(args.seconds, [float(r) for r in args.rates.split(",")], out, args.window)
    result["out"] = str(out)
    print(json.dumps(result, indent=2))
    ok = result["lost"] == 0 and result["seq_gaps"] == 0 and not result["browser_errors"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
