"""The step boundary: after every step the job's active ranks agree (one all-reduce, MAX)
on what happens next (stop, or a switch whose joining ranks are ready), so every rank acts
after the same step and none is left waiting in a collective. Also the union world's
rendezvous that a switch uses."""
from __future__ import annotations

import time
from pathlib import Path

from agents import protocol
from agents.runtime.job_settings import JobSettings
from agents.runtime.rank_reports import Reporter
from agents.runtime.run_files import STOP_FILE
from agents.runtime.worlds import join_world, rendezvous_store


def union_store(order: protocol.JobSwitchOrder, master: bool, timeout: float):
    """The union world's TCPStore: rank 0 serves it, every other rank connects."""
    return rendezvous_store(order.rendezvous, master, timeout)


def join_union(order: protocol.JobSwitchOrder, store, rank: int, timeout: float) -> None:
    join_world(store, f"union-{order.transition_id}", rank, max(order.src_world, order.world), timeout)


def signal_abort(order: protocol.JobSwitchOrder, reason: str) -> None:
    """Tell rank 0 (through the union store's `abort` key) that a switch cannot happen."""
    union_store(order, master=False, timeout=10).set("abort", reason)


class Boundary:
    """The decision all active ranks take together after each step."""

    def __init__(self, settings: JobSettings, rank: int, run_dir: Path, reporter: Reporter) -> None:
        self.settings, self.rank, self.run_dir, self.reporter = settings, rank, run_dir, reporter
        self.done_switches: set[int] = set()
        self.pending: protocol.JobSwitchOrder | None = None  # rank 0: the order being prepared
        self.store = None
        self.seen_at = 0.0
        self.ahead: dict[int, object] = {}  # transition id -> Future of its PreparedSwitch
        self._planner = None

    def _prepare_ahead(self, trainer) -> None:
        """Every old rank: a switch order its agent delivered is planned in a background
        thread while training goes on (plan, program, skipped digests), so that the pause
        does not wait for it. The agent writes the order into the run folder of every node
        with ranks of the job, so no rank has to be told."""
        from concurrent.futures import ThreadPoolExecutor

        from parallelism.engine.switch import prepare_switch

        for path in self.run_dir.glob("switch-*.json"):
            tid = path.stem.split("-", 1)[1]
            if not tid.isdigit() or int(tid) in self.done_switches or int(tid) in self.ahead:
                continue
            order = protocol.JobSwitchOrder.model_validate_json(path.read_text())
            self._planner = self._planner or ThreadPoolExecutor(max_workers=1, thread_name_prefix="plan-ahead")
            self.ahead[int(tid)] = self._planner.submit(
                prepare_switch, trainer.spec, str(trainer.placement.layout), order.layout, self.rank, False,
                staging_bytes=order.staging_bytes, gpus_per_node=order.gpus_per_node, process_of=order.process_of)

    def prepared(self, order: protocol.JobSwitchOrder, spec, src: str):
        """The order's PreparedSwitch, planned ahead (waiting for it if it is still being
        planned) or now."""
        from parallelism.engine.switch import prepare_switch

        future = self.ahead.pop(order.transition_id, None)
        if future is not None:
            try:
                prepared = future.result()
            except Exception:  # noqa: BLE001 (planned again below, where a failure rolls the switch back)
                prepared = None
            if prepared is not None and str(prepared.plan.src.layout) == src:
                return prepared
        return prepare_switch(spec, src, order.layout, self.rank, joining=False, staging_bytes=order.staging_bytes,
                              gpus_per_node=order.gpus_per_node, process_of=order.process_of)

    def _look_for_switch(self) -> None:
        if self.pending is not None:
            return
        for path in sorted(self.run_dir.glob("switch-*.json")):
            order = protocol.JobSwitchOrder.model_validate_json(path.read_text())
            if order.transition_id in self.done_switches:
                continue
            self.pending, self.seen_at = order, time.perf_counter()
            self.store = union_store(order, master=True, timeout=self.settings.timeout_seconds)
            self.reporter.transition(order.transition_id, "preparing")
            return

    def _abandoned(self) -> str | None:
        """Rank 0: give the pending switch up if a joining rank's agent reported it dead
        (the store's `abort` key) or the joining ranks are not ready within the job's
        timeout. The old layout never left: training simply goes on."""
        order = self.pending
        reason = None
        if self.store.check(["abort"]):
            reason = self.store.get("abort").decode(errors="replace")
        elif time.perf_counter() - self.seen_at > self.settings.timeout_seconds:
            joined = int(self.store.add("joined", 0))
            reason = (f"{joined} of {order.world - order.src_world} joining ranks ready after "
                      f"{self.settings.timeout_seconds:.0f} s")
        if reason is None:
            return None
        self.reporter.transition(order.transition_id, "aborted", error=f"switch abandoned: {reason}"[:4000])
        self.done_switches.add(order.transition_id)
        self.pending, self.store = None, None  # closes the store: joining ranks waiting on it fail
        return reason

    def decide(self, trainer) -> tuple[bool, protocol.JobSwitchOrder | None]:
        """(stop, switch order) agreed by every active rank after this step."""
        import torch
        import torch.distributed as dist

        stop = (self.run_dir / STOP_FILE).exists() or (
            self.settings.max_steps is not None and trainer.scalars.step >= self.settings.max_steps)
        self._prepare_ahead(trainer)
        ready = 0
        if self.rank == 0:
            self._look_for_switch()
            if self.pending is not None and self._abandoned() is None:
                joining = max(0, self.pending.world - self.pending.src_world)
                if int(self.store.add("joined", 0)) >= joining:
                    ready = self.pending.transition_id
        planning = any(not future.done() for future in self.ahead.values())
        flags = torch.tensor([int(stop), ready, int(planning)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=trainer.meshes.everyone)
        if flags[0].item():
            return True, None
        if not flags[1].item() or flags[2].item():  # (a rank still planning ahead: switch a step later)
            return False, None
        box = [self.pending]
        dist.broadcast_object_list(box, src=0, group=trainer.meshes.everyone)
        order = box[0]
        if self.rank == 0:
            self.reporter.transition(order.transition_id, "ready", step=trainer.scalars.step,
                                     prepare_seconds=time.perf_counter() - self.seen_at)
        return False, order
