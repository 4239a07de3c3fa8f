"""A cluster page server over a simulated cluster (issue 47: the page at thousands of GPUs): a
fresh SQLite database filled through the services the control plane uses (nodes registered by
their heartbeats, jobs created and placed on GPUs), daphne serving it, and writes through the
same services that make live events on /ws/cluster/ (no agents, no Celery worker).

Used in-process by benchmarks/cluster_page.py; run as a driver process by
tests/browser/test_cluster_page.py (whose own Django is pytest's):

    python -m tests.support.cluster_page --var-dir DIR --nodes 40 --gpus-per-node 8 --jobs 6

prints one JSON line (url, username, password, nodes, jobs) once serving, then takes one
command a line on stdin, `lose <node>` or `quit`, and answers each with `ok <seq>`."""
from __future__ import annotations

import argparse
import itertools
import json
import os
import secrets
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path

USERNAME = "admin"
GIB = 2**30


def configure(var_dir: Path, redis_url: str) -> None:
    """Point this process's Django at a fresh SQLite database under `var_dir` and migrate it.
    Call before anything imports Django's settings."""
    os.environ.update(DYNAPLANE_VAR_DIR=str(var_dir), DATABASE_URL=f"sqlite:///{var_dir}/cluster.sqlite3",
                      REDIS_URL=redis_url, DJANGO_SETTINGS_MODULE="controlplane.settings")
    import django
    from django.core.management import call_command

    django.setup()
    call_command("migrate", verbosity=0)


def node_name(n: int) -> str:
    return f"node-{n:04d}"


def heartbeat(name: str, gpus_per_node: int, *, cpu: float = 40.0, started: datetime | None = None):
    from agents import protocol
    from agents.node.inventory import virtual_gpus

    now = datetime.now(timezone.utc)
    return protocol.AgentHeartbeat(
        node=name, host=f"host-{name}", device="cuda", pid=4242, started_at=started or now, sent_at=now,
        interval_seconds=protocol.HEARTBEAT_SECONDS, gpus=virtual_gpus(gpus_per_node, memory_bytes=80 * GIB),
        host_stats=protocol.HostStats(cpu_percent=cpu, cpu_count=128, memory_used_bytes=200 * GIB,
                                      memory_total_bytes=1024 * GIB))


@dataclass
class Cluster:
    """What fill() made: node names in order; job name -> its (node, index) pairs ([] pending)."""

    gpus_per_node: int
    nodes: list[str]
    jobs: dict[str, list[tuple[str, int]]] = field(default_factory=dict)
    started: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    filled_at: float = 0.0


def place(job, pairs: list[tuple[str, int]]) -> None:
    """Put a pending job on these GPUs and call it running (what a start and rank 0's
    `started` report end in), each change published as the control plane publishes it."""
    from django.db import transaction
    from django.utils import timezone as dj_timezone

    from controlplane.cluster.selectors import gpus_take
    from controlplane.cluster.services import gpus_allocate
    from controlplane.jobs.lifecycle import JobState
    from controlplane.jobs.models import Job
    from controlplane.jobs.services import publish_job

    with transaction.atomic():
        _, rows = gpus_take(lambda free: (None, pairs))
        gpus_allocate(gpus=[rows[pair] for pair in pairs], job=job)
        Job.objects.filter(pk=job.pk).update(
            state=JobState.RUNNING, started_at=dj_timezone.now(),
            placement=[{"rank": r, "node": node, "gpu": gpu} for r, (node, gpu) in enumerate(pairs)])
        job.refresh_from_db()
        publish_job(job, "upsert")


def fill(nodes: int, gpus_per_node: int, jobs: int) -> Cluster:
    """Register `nodes` nodes by heartbeat, then create `jobs` jobs (8 and 4 GPUs in turn;
    every tenth left pending) placed one after another from the third node on."""
    from controlplane.cluster.liveness import kept_since
    from controlplane.cluster.services import node_record_heartbeat
    from controlplane.jobs.services import job_create

    kept_since()  # Redis keeps liveness from now: a node silent since the fill can be lost (lose())
    cluster = Cluster(gpus_per_node, [node_name(n) for n in range(1, nodes + 1)])
    for name in cluster.nodes:
        node_record_heartbeat(report=heartbeat(name, gpus_per_node, started=cluster.started))
    free = ((name, index) for name in cluster.nodes[2:] for index in range(gpus_per_node))
    for j in range(1, jobs + 1):
        size = 8 if j % 2 else 4
        job = job_create(name=f"job-{j:03d}", model="tiny-gpt", gpus=size, global_batch=16, seq_len=16)
        pairs = [] if j % 10 == 0 else list(itertools.islice(free, size))
        if len(pairs) == size:
            place(job, pairs)
            cluster.jobs[job.name] = pairs
        else:
            cluster.jobs[job.name] = []
    cluster.filled_at = time.monotonic()
    return cluster


def lose(cluster: Cluster, name: str) -> list[str]:
    """Node `name` stops beating while every other node beats: the lost-node sweep marks it
    lost (and its GPUs), as it does when an agent dies."""
    from controlplane.cluster.services import node_record_heartbeat, nodes_mark_lost

    time.sleep(max(0.0, cluster.filled_at + 0.6 - time.monotonic()))  # its last beat: at least 0.6 s ago
    now = datetime.now(timezone.utc)
    for other in cluster.nodes:
        if other != name:
            node_record_heartbeat(report=heartbeat(other, cluster.gpus_per_node, started=cluster.started),
                                  received_at=now)
    return nodes_mark_lost(silent_for=timedelta(seconds=0.5), now=now + timedelta(seconds=0.25))


def seq() -> int:
    from controlplane.cluster.events import STREAM
    from controlplane.common.events import current_seq

    return current_seq(STREAM)


def create_user() -> str:
    """The page's user (staff); returns its password."""
    from django.contrib.auth import get_user_model

    password = secrets.token_urlsafe(12)
    get_user_model().objects.create_user(USERNAME, password=password, is_staff=True, is_superuser=True)
    return password


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daphne:
    """daphne serving the configured database (this process's environment) on a free port."""

    def __init__(self, var_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.log = open(var_dir / "daphne.log", "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "--websocket_connect_timeout",
             "30", "controlplane.asgi:application"], stdout=self.log, stderr=subprocess.STDOUT, env=dict(os.environ))
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(self.url + "accounts/login/", timeout=5).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"daphne did not start: {(var_dir / 'daphne.log').read_text()[-2000:]}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


def sign_in(page, url: str, password: str) -> None:
    """The login form, then the cluster page drawn."""
    page.goto(url + "accounts/login/")
    page.get_by_label("Username").fill(USERNAME)
    page.get_by_label("Password").fill(password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_selector("body[data-ready=true]", timeout=60_000)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the cluster page over a simulated cluster (a test driver).")
    parser.add_argument("--var-dir", type=Path, required=True, help="where the database and daphne's log go")
    parser.add_argument("--nodes", type=int, default=40, help="nodes to register")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs each node reports")
    parser.add_argument("--jobs", type=int, default=6, help="jobs to create (every tenth stays pending)")
    args = parser.parse_args(argv)
    configure(args.var_dir, os.environ["REDIS_URL"])
    cluster = fill(args.nodes, args.gpus_per_node, args.jobs)
    password = create_user()
    server = Daphne(args.var_dir)
    try:
        print(json.dumps({"url": server.url, "username": USERNAME, "password": password, "nodes": cluster.nodes,
                          "jobs": cluster.jobs, "seq": seq()}), flush=True)
        for line in sys.stdin:
            command, *rest = line.split()
            if command == "quit":
                break
            if command == "lose":
                lose(cluster, rest[0])
            print(f"ok {seq()}", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
