"""The agent's job runner: one rank process per GPU slot of a JobStartOrder, watched.

One supervisor thread owns every rank process: it starts them (so that the processes'
parent-death signal is tied to a thread that lives as long as the agent, not to a Celery
worker thread), delivers stop requests (the `stop` file the ranks poll at each step
boundary, then SIGTERM / SIGKILL after the grace period) and polls exits. A rank that
exits non-zero makes the agent report `failed` for the job (with the rank's last log
lines) and stop the job's other local ranks; when the agent itself dies, its ranks get
SIGTERM, and their peers fail at their next collective within the job's timeout. A rank
that outlives its world that way waits with its state (agents/runtime/orphan.py): the
agent reports it `orphaned` and hands it the control plane's recovery order.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from agents import protocol
from parallelism.engine.launch import RANK_MALLOC_ENV
from agents.node.log_tail import LogShipper
from agents.runtime.run_files import (STOP_FILE, orphan_marker, recover_file, renumbered_marker, switch_file,
                                      switched_marker, transferring_marker)
from agents.processes import Child

log = logging.getLogger(__name__)


@dataclass
class LocalJob:
    job_id: int
    layout: str
    run_dir: Path
    ranks: dict[int, Child] = field(default_factory=dict)
    stop_deadline: float | None = None
    failed: bool = False
    joining: dict[int, protocol.JobSwitchOrder] = field(default_factory=dict)  # rank -> the switch it joins
    restore_id: int | None = None  # the restart from a checkpoint these ranks are (None: the first start)
    renumbered: set[str] = field(default_factory=set)  # order files whose device map renumbered `ranks`
    leaving: list[Child] = field(default_factory=list)  # processes a switch left rankless, exiting


class JobRunner:
    def __init__(self, send_report, node: str, device: str, broker_url: str, run_root: Path,
                 poll_seconds: float = 0.2, env: dict[str, str] | None = None, send_log=None) -> None:
        self._send_report, self.node, self.device, self.broker_url = send_report, node, device, broker_url
        # send_log(protocol.JobLogTail): rank 0's log tail of each job, when it changes (None: not shipped)
        self._logs = LogShipper(send_log, node, run_root) if send_log is not None else None
        self.env = dict(env or {})  # added to the rank processes' environment
        self.run_root = run_root
        self.poll_seconds = poll_seconds
        self.jobs: dict[int, LocalJob] = {}
        self._pending: dict[int, list[int]] = {}  # start orders not yet carried out
        self._lock = threading.Lock()
        self._commands: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._supervise, name="job-runner", daemon=True)
        self._thread.start()

    # --- called from Celery tasks (any thread) -----------------------------------
    def start(self, order: protocol.JobStartOrder) -> None:
        with self._lock:
            self._pending.setdefault(order.job_id, [s.rank for s in order.ranks])
        self._commands.put(("start", order))

    def stop(self, order: protocol.JobStopOrder) -> None:
        self._commands.put(("stop", order))

    def cancel(self, order: protocol.JobSwitchCancel) -> None:
        self._commands.put(("cancel", order))

    def recover(self, order: protocol.JobRecoverOrder) -> None:
        self._commands.put(("recover", order))

    def switch(self, order: protocol.JobSwitchOrder) -> None:
        joining = [s.rank for s in order.ranks if s.rank >= order.src_world]
        if joining:
            with self._lock:
                self._pending.setdefault(order.job_id, joining)
        self._commands.put(("switch", order))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._commands.put(("shutdown", None))
        self._thread.join(timeout)

    def running(self) -> dict[int, list[int]]:
        """Job id -> local ranks alive or about to start (for tests and the heartbeat)."""
        with self._lock:
            pending = {job_id: list(ranks) for job_id, ranks in self._pending.items()}
        return {**pending, **{job_id: sorted(r for r, c in job.ranks.items() if c.poll() is None)
                              for job_id, job in list(self.jobs.items())}}

    # --- the supervisor thread ------------------------------------------------------
    def _supervise(self) -> None:
        while True:
            try:
                command, payload = self._commands.get(timeout=self.poll_seconds)
            except queue.Empty:
                command, payload = None, None
            try:
                if command == "shutdown":
                    for job in self.jobs.values():
                        self._kill(job)
                    return
                if command in ("start", "switch"):
                    try:
                        (self._start if command == "start" else self._switch)(payload)
                    finally:
                        with self._lock:
                            self._pending.pop(payload.job_id, None)
                elif command == "stop":
                    self._request_stop(payload)
                elif command == "cancel":
                    self._cancel(payload)
                elif command == "recover":
                    self._recover(payload)
                self._poll()
            except Exception:  # the supervisor must outlive any one job's trouble
                log.exception("job runner: %s failed", command or "poll")

    def _start(self, order: protocol.JobStartOrder) -> None:
        old = self.jobs.get(order.job_id)
        if old is not None and order.restore_from and old.restore_id != order.restore_id:
            # A restart from a checkpoint replaces whatever ranks of the job still run here
            # (waiting on a lost peer): they are killed without a failure report.
            log.warning("job %d: restart from %s; stopping the ranks still here", order.job_id, order.restore_from)
            self._drop(old)
        elif old is not None:
            log.warning("job %d already runs here; duplicate start order ignored", order.job_id)
            return
        # Each restart gets its own folder: no switch order or stop file of the old world is seen again.
        suffix = f"-restore-{order.restore_id}" if order.restore_id else ""
        run_dir = self.run_root / f"job-{order.job_id}{suffix}"
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / STOP_FILE).unlink(missing_ok=True)
        order_path = run_dir / f"order-{self.node}.json"
        order_path.write_text(order.model_dump_json())
        job = LocalJob(order.job_id, order.layout, run_dir, restore_id=order.restore_id)
        for slot in order.ranks:
            self._spawn(job, slot, [str(order_path), str(slot.rank)])
        self.jobs[order.job_id] = job
        log.info("job %d (%s): started ranks %s on GPUs %s", order.job_id, order.job_name,
                 [s.rank for s in order.ranks], [s.gpu for s in order.ranks])

    def _switch(self, order: protocol.JobSwitchOrder) -> None:
        """Tell the local ranks (rank 0 acts on it) and start the ranks that join here."""
        job = self.jobs.get(order.job_id)
        if job is not None and job.restore_id != order.restore_id:
            # Ranks of a world the job has left (this node was cut off and the job went on
            # without it; they wait for a recovery order that is not theirs): replaced, unreported.
            log.warning("job %d: ranks %s here belong to its world before restore %s; stopping them", order.job_id,
                        sorted(job.ranks), order.restore_id)
            self._drop(job)
            job = None
        if job is None:
            suffix = f"-restore-{order.restore_id}" if order.restore_id else ""
            job = self.jobs[order.job_id] = LocalJob(order.job_id, order.src_layout,
                                                     self.run_root / f"job-{order.job_id}{suffix}",
                                                     restore_id=order.restore_id)
            job.run_dir.mkdir(parents=True, exist_ok=True)
            (job.run_dir / STOP_FILE).unlink(missing_ok=True)
        order_text = order.model_dump_json()
        joining = [s for s in order.ranks if s.rank >= order.src_world]
        if joining:
            join_path = job.run_dir / f"join-{order.transition_id}-{self.node}.json"
            join_path.write_text(order_text)
            for slot in joining:
                if slot.rank in job.ranks and job.ranks[slot.rank].poll() is None:
                    log.warning("job %d: rank %d already runs here; not started twice", order.job_id, slot.rank)
                    continue
                self._spawn(job, slot, ["--join", str(join_path), str(slot.rank)])
                job.joining[slot.rank] = order
        tmp = job.run_dir / f".switch-{order.transition_id}.tmp"
        tmp.write_text(order_text)
        tmp.replace(job.run_dir / switch_file(order.transition_id))  # rank 0 never reads half a file
        job.layout = order.layout
        log.info("job %d: switch %d to %s; ranks joining here: %s", order.job_id, order.transition_id, order.layout,
                 [s.rank for s in joining])

    def _drop(self, job: LocalJob) -> None:
        """The ranks here of a world the job has left: killed, without a failure report."""
        job.failed = True
        self._kill(job)
        del self.jobs[job.job_id]

    def _recover(self, order: protocol.JobRecoverOrder) -> None:
        """Hand the recovery order to the job's ranks waiting here (they outlived their world)
        and renumber them: from now on they are the ranks of restore `order.restore_id`."""
        job = self.jobs.get(order.job_id)
        if job is None or job.failed:
            error = f"recovery order for restore {order.restore_id}: no waiting ranks of the job here"
            log.error("job %d: %s", order.job_id, error)
            self._send_report(protocol.job_report(
                job_id=order.job_id, node=self.node, kind="failed", ranks=tuple(m.new for m in order.ranks),
                layout=order.layout, error=error, restore_id=order.restore_id,
                sent_at=datetime.datetime.now(datetime.timezone.utc)))
            return
        tmp = job.run_dir / f".recover-{order.restore_id}.tmp"
        tmp.write_text(order.model_dump_json())
        tmp.replace(job.run_dir / recover_file(order.restore_id))  # the ranks never read half a file
        moves = {m.old: m.new for m in order.ranks}
        for old, child in list(job.ranks.items()):
            if old not in moves:  # not needed in the new world (it would leave on reading the order)
                child.terminate()
                child.kill_group()
        job.ranks = {moves[old]: child for old, child in job.ranks.items() if old in moves}
        job.restore_id, job.layout, job.joining = order.restore_id, order.layout, {}
        log.warning("job %d: restore %d on the survivors, ranks %s here", order.job_id, order.restore_id,
                    sorted(moves.items()))

    def _report_orphans(self, job: LocalJob) -> None:
        """The job's ranks here that outlived their world (their marker files): `orphaned`,
        one report per step, each marker once."""
        by_step: dict[tuple[int, str], list[int]] = {}
        for rank in sorted(job.ranks):
            path = job.run_dir / orphan_marker(rank)
            if not path.exists():
                continue
            try:
                mark = json.loads(path.read_text())
            except ValueError:
                continue
            path.unlink(missing_ok=True)
            by_step.setdefault((int(mark["step"]), str(mark.get("error", ""))[:3000]), []).append(rank)
        for (step, error), ranks in by_step.items():
            log.warning("job %d: ranks %s outlived their world after step %d: %s", job.job_id, ranks, step, error)
            self._send_report(protocol.job_report(
                job_id=job.job_id, node=self.node, kind="orphaned", ranks=tuple(ranks), step=step,
                layout=job.layout, error=error, restore_id=job.restore_id,
                sent_at=datetime.datetime.now(datetime.timezone.utc)))

    def _spawn(self, job: LocalJob, slot: protocol.RankSlot, args: list[str]) -> None:
        env = {**os.environ, "DYNAPLANE_NODE": self.node, "DYNAPLANE_BROKER_URL": self.broker_url,
               **{k: v for k, v in RANK_MALLOC_ENV.items() if k not in os.environ}, **self.env}
        if self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(slot.gpu)
        child = Child(f"job-{job.job_id}-rank-{slot.rank}", [sys.executable, "-m", "agents.runtime.worker", *args],
                      job.run_dir / f"rank-{slot.rank}.log", critical=False)
        child.start(env)
        job.ranks[slot.rank] = child

    def _request_stop(self, order: protocol.JobStopOrder) -> None:
        job = self.jobs.get(order.job_id)
        if job is None:
            log.info("job %d: stop order for a job not running here", order.job_id)
            return
        (job.run_dir / STOP_FILE).touch()
        job.stop_deadline = _now() + order.grace_seconds

    def _renumber(self, job: LocalJob) -> None:
        """A switch or recovery whose device map gave ranks other processes is past its point
        of rollback (a rank of the new world left its marker here, named after the order's
        file): the processes here take the numbers of their new ranks (order.process_of);
        those that take none are exiting."""
        prefix = renumbered_marker("")
        for path in job.run_dir.glob(prefix + "*"):
            name = path.name.removeprefix(prefix)
            kind = protocol.JobSwitchOrder if name.startswith("switch-") else protocol.JobRecoverOrder
            if name in job.renumbered or not (job.run_dir / name).exists() or not name.endswith(".json") \
                    or not name.startswith(("switch-", "recover-")):
                continue
            job.renumbered.add(name)
            order = kind.model_validate_json((job.run_dir / name).read_text())
            ranks: dict[int, Child] = {}
            for process, child in job.ranks.items():
                new = order.rank_of(process)
                if new is None:
                    job.leaving.append(child)
                else:
                    ranks[new] = child
            job.ranks = ranks
            if kind is protocol.JobSwitchOrder:
                job.joining = {p: o for p, o in job.joining.items() if o.transition_id != order.transition_id}
            log.info("job %d: %s renumbered the ranks here: %s", job.job_id, name, sorted(ranks))

    def _poll(self) -> None:
        for job_id, job in list(self.jobs.items()):
            self._renumber(job)
            for child in [c for c in job.leaving if c.poll() is not None]:
                child.kill_group()  # closes its log
                job.leaving.remove(child)
            for rank, child in list(job.ranks.items()):
                code = child.poll()
                if code in (None, 0) or job.failed or rank not in job.ranks:  # (gone with an aborted switch)
                    continue
                order = job.joining.get(rank)
                if order is not None and not (job.run_dir / switched_marker(order.transition_id, rank)).exists():
                    if (job.run_dir / transferring_marker(order.transition_id, rank)).exists():
                        # Lost during the transfer: the old ranks roll back (rank 0 reports it).
                        log.error("job %d: joining rank %d died during switch %d: %s", job_id, rank,
                                  order.transition_id, child.log_tail(5))
                        self._drop_joining(job, order)
                    else:
                        self._abort_switch(job, order, rank, code, child.log_tail(15))
                    continue
                job.failed = True
                self._report_failure(job, rank, code, child.log_tail(15))
                self._kill(job)
            if not job.failed:  # (after the exits: a rank that died makes its waiting peers here moot)
                self._report_orphans(job)
            if job.stop_deadline is not None and _now() > job.stop_deadline:
                log.warning("job %d: ranks still alive after the stop order's grace period; killing them", job_id)
                job.stop_deadline = None
                self._kill(job)
                if 0 in job.ranks and not job.failed:  # rank 0 speaks for the job, and it is gone now
                    self._send_report(protocol.job_report(
                        job_id=job.job_id, node=self.node, kind="stopped", layout=job.layout,
                        error="killed after the stop order's grace period (a step outlasted it)",
                        restore_id=job.restore_id, sent_at=datetime.datetime.now(datetime.timezone.utc)))
            ended = not job.leaving and all(c.poll() is not None for c in job.ranks.values())
            if self._logs is not None and 0 in job.ranks:  # rank 0's log: its latest lines, its last ones at exit
                ship = self._logs.final if ended else self._logs.poll
                ship(job_id, 0, job.ranks[0].log_path, job.restore_id)
            if ended:
                for child in job.ranks.values():
                    child.kill_group()  # closes the log; nothing is left in the group
                del self.jobs[job_id]

    def _abort_switch(self, job: LocalJob, order: protocol.JobSwitchOrder, rank: int, code: int, tail: str) -> None:
        """A joining rank died before the switch: the old layout never left, so the switch is
        abandoned, not the job. Rank 0 learns it through the union store's `abort` key;
        this node's other ranks joining the same switch are stopped."""
        error = f"joining rank {rank} on node {self.node} exited with code {code} before the switch: {tail[-3000:]}"
        log.error("job %d: switch %d aborted: %s", job.job_id, order.transition_id, error)
        self._tell_rank0(job, job.run_dir / f"join-{order.transition_id}-{self.node}.json", error)
        self._drop_joining(job, order)
        self._send_report(protocol.TransitionReport(
            job_id=job.job_id, transition_id=order.transition_id, node=self.node, state="aborted", error=error,
            sent_at=datetime.datetime.now(datetime.timezone.utc)))

    def _cancel(self, order: protocol.JobSwitchCancel) -> None:
        """Abandon a switch: tell rank 0 through its store (from the switch order this node
        got) and stop this node's joining ranks for it."""
        job = self.jobs.get(order.job_id)
        path = job.run_dir / switch_file(order.transition_id) if job else None
        if path is None or not path.exists():
            log.info("job %d: cancel of switch %d, which this node does not hold", order.job_id, order.transition_id)
            return
        switch = protocol.JobSwitchOrder.model_validate_json(path.read_text())
        self._drop_joining(job, switch)
        self._tell_rank0(job, path, f"cancelled by the control plane: {order.reason}")

    def _tell_rank0(self, job: LocalJob, order_path: Path, reason: str) -> None:
        # The agent stays free of torch: a short-lived process sets the key in rank 0's store.
        told = subprocess.run([sys.executable, "-m", "agents.runtime.worker", "--abort", str(order_path), reason[:2000]],
                              capture_output=True, text=True, timeout=60, env={**os.environ, **self.env})
        if told.returncode != 0:  # rank 0 gone or its store closed: its own timeout then aborts
            log.warning("job %d: could not tell rank 0 about the abort: %s", job.job_id, told.stderr[-500:])

    @staticmethod
    def _drop_joining(job: LocalJob, order: protocol.JobSwitchOrder) -> None:
        """Stop and forget this node's ranks that were joining a failed switch."""
        for other, other_order in list(job.joining.items()):
            if other_order.transition_id == order.transition_id:
                job.joining.pop(other)
                child = job.ranks.pop(other)
                child.terminate()
                child.kill_group()

    def _report_failure(self, job: LocalJob, rank: int, code: int, tail: str) -> None:
        error = f"rank {rank} on node {self.node} exited with code {code}: {tail[-3500:]}"
        log.error("job %d: %s", job.job_id, error)
        self._send_report(protocol.job_report(
            job_id=job.job_id, node=self.node, kind="failed", ranks=(rank,), layout=job.layout,
            error=error, restore_id=job.restore_id, sent_at=datetime.datetime.now(datetime.timezone.utc)))

    @staticmethod
    def _kill(job: LocalJob) -> None:
        children = [*job.ranks.values(), *job.leaving]
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.process.wait(timeout=5)
            except Exception:
                pass
            child.kill_group()


def _now() -> float:
    import time

    return time.monotonic()
