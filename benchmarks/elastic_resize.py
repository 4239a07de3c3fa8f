"""Online resize against stop-checkpoint-restart, both through the control plane (issue 6).

A real stack (`dynaplane up`: daphne, the control-plane Celery worker, embedded Valkey,
SQLite, two agents with two virtual GPUs each, one rank process per GPU) trains the same
model three ways, one job at a time:

(a) online: a job on SMALL GPUs is resized to LARGE (`POST /api/jobs/{id}/resize`) while
    it trains, then back to SMALL. The pause is the transition's `pause_seconds` (rank 0:
    end of the last old step to the start of the first new step); `prepare_seconds` is the
    joining ranks' bring-up (order seen -> all joined) that ran while the old ranks trained.
(b) stop-checkpoint-restart: a job on SMALL GPUs trains K steps, writes its periodic DCP
    checkpoint at step K and stops (max_steps=K, checkpoint_interval=K: the best case, no
    step is lost or redone); as soon as the API shows it stopped, a new job is created on
    LARGE GPUs with `resume_from` that checkpoint (resume.py), trains to 2K, checkpoints
    and stops; a third job resumes that one on SMALL GPUs.

Both are also measured the same way from outside, by polling GET /api/jobs/{id} every
POLL seconds: pause = (first seen step k+1) - (its step_seconds) - (first seen step k),
where k is the last step of the old layout (or the old job). The report latency of the two
step reports cancels; what remains is polling granularity (+- POLL).

    flock /tmp/dynaplane-stack.lock .venv/bin/python -m benchmarks.elastic_resize
    ... --model tiny-gpt --steps 3      (a quick check of the path)
    ... --across-hosts                  (issue 44: the online resize on loopback, then with each
                                         agent on a host of its own, and the link's bandwidth)

--across-hosts runs (a) twice in one process: on the loopback stack above, then on a control
plane and two agent hosts (Linux network namespaces joined by veth pairs and a bridge,
tests/support/host_cluster.py; needs root), where the joining ranks' state crosses the link; the
link's TCP bandwidth is measured in the same run, one stream between the two hosts.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.error
from pathlib import Path

from tests.support.stack import StackProcess, wait_for

POLL = 0.1


class StepWatch(threading.Thread):
    """Polls one job: the monotonic time each step number was first seen, and the states."""

    def __init__(self, stack: StackProcess, job_id: int) -> None:
        super().__init__(daemon=True)
        self.stack, self.job_id = stack, job_id
        self.seen: dict[int, float] = {}
        self.job: dict = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                job = self.stack.get(f"api/jobs/{self.job_id}", token=True)
            except (urllib.error.URLError, OSError, ValueError):
                time.sleep(POLL)
                continue
            now = time.monotonic()
            if job.get("step") is not None:
                self.seen.setdefault(job["step"], now)
            self.job = job
            time.sleep(POLL)

    def wait(self, predicate, timeout: float, what: str) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.job
            if job and job["state"] == "failed":
                raise SystemExit(f"job {job['name']} failed while waiting for {what}: {job['error']}")
            if job and predicate(job):
                return job
            time.sleep(POLL / 2)
        raise SystemExit(f"job {self.job_id}: {what} not reached within {timeout:.0f} s (last: {self.job})")

    def steps_seconds(self, first: int, last: int) -> float:
        """The trained seconds of steps first..last (the job's step_seconds series)."""
        live = self.stack.get(f"api/jobs/{self.job_id}/live", token=True)["metrics"]["step_seconds"]
        seconds = dict(zip(live["x"], live["y"]))
        return sum(seconds.get(float(step), float("nan")) for step in range(first, last + 1))


def observed_pause(old: StepWatch, new: StepWatch, last_old_step: int) -> float:
    """From outside: start of the first new step minus the end of the last old one. A step
    shorter than the polling interval may never be seen: the first new step's start is then
    the first step seen after it less the steps trained up to it, and the last old step's
    end the last step seen before it plus the steps trained since."""
    first = last_old_step + 1
    after = min((step for step in new.seen if step >= first), default=None)
    before = max((step for step in old.seen if step <= last_old_step), default=None)
    if after is None or before is None:
        return float("nan")
    started = new.seen[after] - new.steps_seconds(first, after)
    ended = old.seen[before] + (old.steps_seconds(before + 1, last_old_step) if before < last_old_step else 0.0)
    return started - ended


def create(stack: StackProcess, **body) -> StepWatch:
    job = stack.post("api/jobs", body)
    watch = StepWatch(stack, job["id"])
    watch.start()
    return watch


def transition_done(stack: StackProcess, transition_id: int, timeout: float) -> dict:
    def done():
        row = stack.get(f"api/transitions/{transition_id}", token=True)
        return row if row["state"] in ("committed", "aborted", "rolled_back") else None
    row, _ = wait_for(done, timeout, interval=POLL)
    if row["state"] != "committed":
        raise SystemExit(f"transition {transition_id} {row['state']}: {row['reason']}")
    return row


def online(stack: StackProcess, args, common: dict) -> list[dict]:
    """(a): SMALL -> LARGE -> SMALL while training."""
    watch = create(stack, name="online", gpus=args.small, checkpoint_interval=0, **common)
    rows = []
    warm = args.steps
    for gpus in (args.large, args.small):
        watch.wait(lambda j: (j["step"] or 0) >= warm, args.timeout, f"step {warm}")
        asked_step = watch.job["step"]
        planned = stack.post(f"api/jobs/{watch.job_id}/resize", {"gpus": gpus})
        row = transition_done(stack, planned["id"], args.timeout)
        last = row["step"]
        watch.wait(lambda j: (j["step"] or 0) >= last + 2 and j["state"] == "running", args.timeout,
                   f"step {last + 2} after the switch")
        rows.append({
            "direction": f"{row['source_world']} -> {row['destination_world']}", "layouts":
            f"{row['source_layout']} -> {row['destination_layout']}", "last_old_step": last,
            "pause_seconds": row["pause_seconds"], "observed_pause_seconds": observed_pause(watch, watch, last),
            "prepare_seconds": row["prepare_seconds"] or 0.0, "transfer_seconds": row["transfer_seconds"],
            "verify_seconds": row["verify_seconds"], "network_bytes": row["network_bytes"],
            "old_steps_while_preparing": last - asked_step, "verified": row["verification"].get("verified"),
            "phases": row["verification"].get("phases") or {}})
        warm = last + 2 + args.steps
    stack.post(f"api/jobs/{watch.job_id}/stop", {})
    watch.wait(lambda j: j["state"] == "stopped", args.timeout, "stopped")
    watch.done.set()
    return rows


def restart(stack: StackProcess, args, common: dict) -> list[dict]:
    """(b): SMALL (K steps, checkpoint, stop) -> new job on LARGE from it (to 2K) -> SMALL."""
    k = args.steps
    old = create(stack, name="restart-0", gpus=args.small, checkpoint_interval=k, max_steps=k, **common)
    rows = []
    for n, gpus in enumerate((args.large, args.small), start=1):
        stopped = old.wait(lambda j: j["state"] == "stopped", args.timeout, "stopped after its checkpoint")
        last = stopped["checkpoint_step"]
        assert stopped["step"] == last, f"the old job trained past its checkpoint: {stopped}"
        new = create(stack, name=f"restart-{n}", gpus=gpus, checkpoint_interval=k if n == 1 else 0,
                     max_steps=last + (k if n == 1 else 2), resume_from=stopped["checkpoint_path"], **common)
        new.wait(lambda j: (j["step"] or 0) >= last + 1, args.timeout, f"step {last + 1} after the restart")
        (row,) = stack.get(f"api/transitions?job={new.job_id}", token=True)["results"]
        rows.append({
            "direction": f"{stopped['world_size']} -> {gpus}", "layouts": f"{stopped['layout']} -> {row['destination_layout']}",
            "last_old_step": last, "observed_pause_seconds": observed_pause(old, new, last),
            "checkpoint_seconds": stopped["checkpoint_seconds"], "load_seconds": row["transfer_seconds"],
            "verified": row["verification"].get("verified")})
        old.done.set()
        old = new
    old.wait(lambda j: j["state"] == "stopped", args.timeout, "stopped")
    old.done.set()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-124m")
    parser.add_argument("--small", type=int, default=2, help="GPUs before and after (default 2)")
    parser.add_argument("--large", type=int, default=4, help="GPUs in between (default 4)")
    parser.add_argument("--steps", type=int, default=2, help="steps before each switch or restart (K)")
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one phase")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--across-hosts", action="store_true",
                        help="the online resize on loopback and across two test hosts (network namespaces), "
                             "with the link's bandwidth; no restart runs")
    args = parser.parse_args(argv)
    common = {"model": args.model, "global_batch": args.global_batch, "micro_batch": 1, "seq_len": args.seq_len}
    if args.across_hosts:
        return across_hosts(args, common)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        stack = StackProcess(Path(tmp), agents=2, gpus_per_agent=2, env={"DATABASE_URL": None, "REDIS_URL": None})
        stack.start()
        try:
            stack.wait_ready(timeout=180)
            started = time.monotonic()
            a = online(stack, args, common)
            b = restart(stack, args, common)
            wall = time.monotonic() - started
        except BaseException:
            print(stack.output()[-4000:], file=sys.stderr)
            raise
        finally:
            stack.stop()
    print(f"{args.model}, global_batch {args.global_batch}, seq {args.seq_len}, {args.small} <-> {args.large} "
          f"virtual GPUs (CPU ranks); load average before {load_before[0]:.1f}, after {os.getloadavg()[0]:.1f}; "
          f"{wall:.0f} s")
    print(f"{'direction':>9} {'online pause':>12} {'(observed)':>10} {'restart pause':>13} {'ratio':>6} "
          f"{'(observed)':>10} {'prepare hidden':>14} {'old steps':>9} {'ckpt':>5} {'load':>5}")
    results = []
    for online_row, restart_row in zip(a, b):
        ratio = restart_row["observed_pause_seconds"] / online_row["pause_seconds"]
        observed_ratio = restart_row["observed_pause_seconds"] / online_row["observed_pause_seconds"]
        prepare, pause = online_row["prepare_seconds"], online_row["pause_seconds"]
        hidden = prepare / (prepare + pause) if prepare + pause else 0.0
        print(f"{online_row['direction']:>9} {pause:>11.2f}s {online_row['observed_pause_seconds']:>9.2f}s "
              f"{restart_row['observed_pause_seconds']:>12.2f}s {ratio:>5.1f}x {observed_ratio:>9.1f}x "
              f"{prepare:>6.2f}s ({hidden:>4.0%}) {online_row['old_steps_while_preparing']:>9} "
              f"{restart_row['checkpoint_seconds']:>4.1f}s {restart_row['load_seconds'] or 0:>4.1f}s")
        results.append({"online": online_row, "restart": restart_row, "ratio": ratio,
                         "observed_ratio": observed_ratio, "hidden_fraction": hidden})
    for row in results:
        phases = row["online"]["phases"]
        if phases:
            print(f"{row['online']['direction']:>9} pause by phase (rank 0): "
                  + ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items() if seconds >= 0.005))
    print("online pause: the transition's pause_seconds (rank 0); (observed): the same gap seen through the API; "
          "restart pause: observed (includes the checkpoint write); prepare hidden: bring-up while the old ranks "
          "trained, share of bring-up + pause; old steps: steps the old layout trained between the request and the "
          "switch")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "load_before": load_before, "results": results},
                                        indent=2))
    return 0


def across_hosts(args, common: dict) -> int:
    """(a) on the loopback stack, then across two hosts (each agent in a namespace of its own)."""
    from tests.support.host_cluster import host_cluster, link_bandwidth

    load_before = os.getloadavg()
    per_host = max(args.small, args.large) // 2
    with tempfile.TemporaryDirectory(prefix="elastic-bench-") as tmp:
        stack = StackProcess(Path(tmp) / "loopback", agents=2, gpus_per_agent=per_host,
                             env={"DATABASE_URL": None, "REDIS_URL": None})
        stack.start()
        try:
            stack.wait_ready(timeout=180)
            loopback = online(stack, args, common)
        finally:
            stack.stop()
        with host_cluster(Path(tmp) / "hosts", ["host-1", "host-2"], gpus_per_host=per_host) as (stack, hosts):
            bandwidth = link_bandwidth(hosts, "host-1", "host-2")
            across = online(stack, args, common)
            bandwidth_after = link_bandwidth(hosts, "host-2", "host-1")
    print(f"{args.model}, global_batch {args.global_batch}, seq {args.seq_len}, {args.small} <-> {args.large} "
          f"virtual GPUs, {per_host} per agent; load average before {load_before[0]:.1f}, after "
          f"{os.getloadavg()[0]:.1f}; link between the hosts (one TCP stream, this run): "
          f"{bandwidth / 1e9:.2f} GB/s before, {bandwidth_after / 1e9:.2f} GB/s after")
    print(f"{'direction':>9} {'loopback pause':>14} {'hosts pause':>11} {'transfer (loopback / hosts)':>28} "
          f"{'moved':>9} {'achieved over the link':>22} verified")
    rows = []
    for here, there in zip(loopback, across):
        moved = there["network_bytes"] or 0
        rate = moved / there["transfer_seconds"] if there["transfer_seconds"] else 0.0
        print(f"{there['direction']:>9} {here['pause_seconds']:>13.2f}s {there['pause_seconds']:>10.2f}s "
              f"{here['transfer_seconds'] or 0:>13.2f}s / {there['transfer_seconds'] or 0:>5.2f}s "
              f"{moved / 1e9:>7.2f}GB {rate / 1e9:>19.2f}GB/s {here['verified'] and there['verified']}")
        rows.append({"loopback": here, "hosts": there, "achieved_bytes_per_second": rate})
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "load_before": load_before, "rows": rows,
                                         "link_bytes_per_second": [bandwidth, bandwidth_after]}, indent=2))
    return 0 if all(r["loopback"]["verified"] and r["hosts"]["verified"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
