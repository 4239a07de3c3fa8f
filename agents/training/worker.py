"""One rank of a job started by a node agent: `python -m agents.training.worker ORDER RANK`.

ORDER is the JobStartOrder (agents/protocol.py) the agent wrote as JSON into the job's
run folder; RANK is this process's rank. The rank joins the job's torch.distributed
world at the order's rendezvous, builds its ParallelTrainer and trains step after step.

Stopping is agreed, never one-sided: after every step all ranks all-reduce (MAX) a flag
that is 1 on a rank whose agent asked it to stop (the file `stop` in the run folder) or
when max_steps is reached, so every rank leaves after the same step and no peer is left
waiting in a collective. Rank 0 speaks for the job: it sends `started`, `step` and
`stopped` JobReports to the control plane; a rank that fails exits non-zero with its
traceback on stderr, and its agent reports the failure.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from pathlib import Path

from agents import protocol

STOP_FILE = "stop"


class Reporter:
    """Sends JobReports to the control queue (rank 0 only; other ranks stay silent)."""

    def __init__(self, order: protocol.JobStartOrder, rank: int, node: str, broker_url: str | None) -> None:
        self.order, self.node = order, node
        self.app = None
        if rank == 0 and broker_url:
            from celery import Celery

            self.app = Celery(f"job-{order.job_id}-rank-0", broker=broker_url, set_as_current=False)
            self.app.conf.update(task_serializer="json", broker_connection_retry_on_startup=True)

    def send(self, kind: str, **fields) -> None:
        if self.app is None:
            return
        report = protocol.JobReport(job_id=self.order.job_id, node=self.node, kind=kind, layout=self.order.layout,
                                    sent_at=datetime.datetime.now(datetime.timezone.utc), **fields)
        self.app.send_task(protocol.CONTROL_JOB_REPORT, args=[report.model_dump(mode="json")],
                           queue=protocol.CONTROL_QUEUE)


def _init_world(order: protocol.JobStartOrder, rank: int) -> None:
    import torch
    import torch.distributed as dist

    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{order.rendezvous}", rank=rank, world_size=order.world,
                            timeout=datetime.timedelta(seconds=order.timeout_seconds))


def train(order: protocol.JobStartOrder, rank: int, run_dir: Path, node: str, broker_url: str | None) -> int:
    """Train until stopped; returns the number of steps done."""
    import torch
    import torch.distributed as dist

    from agents.layout.catalog import get_model
    from agents.layout.placement import place
    from agents.training.parallel import ParallelTrainer, TrainConfig, initial_shards

    torch.set_num_threads(int(os.environ.get("DYNAPLANE_RANK_THREADS", "1")))
    reporter = Reporter(order, rank, node, broker_url)
    placement = place(get_model(order.model), order.layout)
    dp = next(iter(placement.modules.values())).dp
    config = TrainConfig(model=order.model, global_batch=order.global_batch, seq_len=order.seq,
                         micro_batches=order.global_batch // (order.micro_batch * dp), seed=order.seed,
                         total_steps=order.max_steps or 10_000)
    _init_world(order, rank)
    try:
        trainer = ParallelTrainer(config, order.layout, rank, initial_shards(order.model, placement, rank, order.seed))
        stop_file = run_dir / STOP_FILE
        steps = 0
        while True:
            result = trainer.step()
            steps += 1
            if result is not None and rank == 0:
                if steps == 1:
                    reporter.send("started", step=result.step)
                if steps % order.report_every == 0:
                    reporter.send("step", step=result.step, loss=result.loss, step_seconds=result.seconds,
                                  tokens_per_second=result.tokens / result.seconds)
            done = stop_file.exists() or (order.max_steps is not None and steps >= order.max_steps)
            flag = torch.tensor([1 if done else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
        reporter.send("stopped", step=trainer.scalars.step)
        return steps
    finally:
        dist.destroy_process_group()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m agents.training.worker ORDER_JSON RANK", file=sys.stderr)
        return 2
    path, rank = Path(argv[0]), int(argv[1])
    order = protocol.JobStartOrder.model_validate_json(path.read_text())
    started = time.perf_counter()
    steps = train(order, rank, path.parent, os.environ.get("DYNAPLANE_NODE", ""),
                  os.environ.get("DYNAPLANE_BROKER_URL"))
    print(f"rank {rank}: {steps} steps in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
