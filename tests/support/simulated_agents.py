"""Agents simulated at the message level, on the real path: heartbeats posted to Redis as agents
post them (agents/liveness.py), rank 0's reports through the ReportBatcher rank 0 uses
(agents/runtime/batching.py) as sealed control.ingest_events tasks. For benchmarks and tests
that need hundreds of nodes or a control plane under load without running training."""
from __future__ import annotations

import multiprocessing
import queue
import threading
import time
from datetime import datetime, timezone

import redis
from celery import Celery

from agents import protocol
from agents.liveness import HeartbeatPoster
from agents.node.inventory import virtual_gpus
from agents.runtime.batching import ReportBatcher
from agents.seal import AgentKey, seal


class Heartbeats:
    """N nodes' heartbeats, each node every interval at its own phase, from one thread (a post is
    one Redis round trip). `silence(name)` stops one node; `posted` counts posts."""

    def __init__(self, redis_url: str, keys: dict[str, AgentKey], gpus_per_node: int,
                 interval: float = protocol.HEARTBEAT_SECONDS) -> None:
        self.poster, self.keys, self.interval = HeartbeatPoster(redis_url), keys, interval
        self.started = datetime.now(timezone.utc)
        self.gpus = virtual_gpus(gpus_per_node, memory_bytes=80 * 2**30)
        self.names = sorted(keys)
        self.jobs: dict[str, dict[int, list[int]]] = {}  # name -> {job id: its ranks there} (what it runs)
        self.silent: dict[str, float] = {}  # name -> the time of its last post
        self.last_post: dict[str, float] = {}
        self.posted = 0
        self.late = 0.0  # the most a post ran behind its time
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)

    def report(self, n: int, name: str) -> dict:
        now = datetime.now(timezone.utc)
        return protocol.AgentHeartbeat(
            node=name, host=f"host-{name}", device="cpu", pid=10_000 + n, started_at=self.started, sent_at=now,
            interval_seconds=self.interval, gpus=self.gpus,
            jobs=tuple(protocol.RunningJob(job_id=job, ranks=tuple(ranks))
                       for job, ranks in sorted(self.jobs.get(name, {}).items())),
            host_stats=protocol.HostStats(cpu_percent=40.0 + (n % 7), cpu_count=128, memory_used_bytes=2**40,
                                          memory_total_bytes=2**41)).model_dump(mode="json")

    def post(self, n: int, name: str) -> None:
        body = self.report(n, name)
        self.poster.post(name, body, seal(self.keys[name], name, protocol.CONTROL_AGENT_HEARTBEAT, body))
        self.last_post[name] = time.time()
        self.posted += 1

    def beat_all_once(self) -> None:
        for n, name in enumerate(self.names):
            self.post(n, name)

    def silence(self, name: str) -> float:
        self.silent[name] = self.last_post.get(name, time.time())
        return self.silent[name]

    def _run(self) -> None:
        start, count, k = time.monotonic(), len(self.names), 0
        while not self.stop.is_set():
            due = start + k * self.interval / count
            delay = due - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                self.late = max(self.late, -delay)
            n = k % count
            name = self.names[n]
            if name not in self.silent:
                try:
                    self.post(n, name)
                except (redis.RedisError, OSError):  # (an agent tries again next beat)
                    pass
            k += 1


class RankZeros:
    """Each job's rank 0 as the product has it: its reports go through a ReportBatcher
    (agents/runtime/batching.py) as control.ingest_events tasks."""

    def __init__(self, app: Celery, rank_zero_nodes: dict[int, str], keys: dict[str, AgentKey], window: float) -> None:
        def send(batch: protocol.ReportBatch) -> None:
            body = batch.model_dump(mode="json")
            app.send_task(protocol.CONTROL_INGEST_EVENTS, args=[body], queue=protocol.CONTROL_QUEUE,
                          kwargs={"seal": seal(keys[batch.node], batch.node, protocol.CONTROL_INGEST_EVENTS, body)})

        self.send, self.window = send, window
        self.nodes = dict(rank_zero_nodes)
        self.batchers = {job_id: ReportBatcher(send, job_id=job_id, node=node, window=window)
                         for job_id, node in rank_zero_nodes.items()}

    def add_job(self, job_id: int, node: str) -> None:
        self.nodes[job_id] = node
        self.batchers[job_id] = ReportBatcher(self.send, job_id=job_id, node=node, window=self.window)

    def __call__(self, job_id: int, kind: str, **fields) -> None:
        self.batchers[job_id].add(protocol.JOB_REPORTS.validate_python(
            dict(job_id=job_id, node=self.nodes[job_id], kind=kind, sent_at=datetime.now(timezone.utc), **fields)))

    def close(self) -> None:
        for batcher in self.batchers.values():
            batcher.close()


class HeartbeatProcess:
    """Heartbeats (above) posted from a process of their own, as agents post from theirs: in the
    simulator's process they shared one interpreter with the report senders and the websockets,
    and on a saturated machine ran up to 41 s late, so that live nodes were found lost
    (benchmarks/cluster_scale.py). The same surface: `jobs` (push_jobs() sends it), silence(),
    `posted`, `late`, `stop`, beat_all_once() and `thread`-like start()."""

    def __init__(self, redis_url: str, keys: dict[str, AgentKey], gpus_per_node: int,
                 interval: float = protocol.HEARTBEAT_SECONDS) -> None:
        context = multiprocessing.get_context("spawn")  # (the simulator runs threads: no fork)
        self.jobs: dict[str, dict[int, list[int]]] = {}
        self._commands, self._replies = context.Queue(), context.Queue()
        self._posted, self._late = context.Value("q", 0), context.Value("d", 0.0)
        self._process = context.Process(target=_heartbeat_process, name="heartbeats", daemon=True,
                                        args=(redis_url, keys, gpus_per_node, interval, self._commands,
                                              self._replies, self._posted, self._late))
        self.stop = _Stop(self._commands)

    def start(self) -> None:
        """Post every node's heartbeat once, then every interval (returns once the first are posted)."""
        self._process.start()
        if self._replies.get(timeout=120) != "started":
            raise RuntimeError("the heartbeat process did not start")

    def push_jobs(self) -> None:
        self._commands.put(("jobs", {node: dict(runs) for node, runs in self.jobs.items()}))

    def silence(self, name: str) -> float:
        self._commands.put(("silence", name))
        return self._replies.get(timeout=30)

    @property
    def posted(self) -> int:
        return self._posted.value

    @property
    def late(self) -> float:
        return self._late.value


class _Stop:
    def __init__(self, commands) -> None:
        self._commands = commands

    def set(self) -> None:
        self._commands.put(("stop", None))


def _heartbeat_process(redis_url, keys, gpus_per_node, interval, commands, replies, posted, late) -> None:
    beats = Heartbeats(redis_url, keys, gpus_per_node, interval)
    beats.beat_all_once()
    beats.thread.start()
    replies.put("started")
    while True:
        posted.value, late.value = beats.posted, beats.late
        try:
            what, arg = commands.get(timeout=0.5)
        except queue.Empty:
            continue
        if what == "jobs":
            beats.jobs = arg
        elif what == "silence":
            replies.put(beats.silence(arg))
        elif what == "stop":
            beats.stop.set()
            posted.value, late.value = beats.posted, beats.late
            return
