"""One rank of a job run by a node agent.

    python -m agents.runtime.worker ORDER RANK          a rank of a starting job
    python -m agents.runtime.worker --join ORDER RANK   a rank joining at a layout switch
    python -m agents.runtime.worker --abort ORDER WHY   (agents) abandon a switch being prepared

ORDER is the JobStartOrder / JobSwitchOrder (agents/protocol.py) the agent wrote as JSON
into the job's run folder. The rank trains step after step; after every step the job's
active ranks agree (one all-reduce, MAX) on what happens next, so that every rank acts
after the same step and none is left waiting in a collective:
- stop: a rank's agent asked (the file `stop` in its run folder) or max_steps is reached;
- switch: rank 0's agent delivered a JobSwitchOrder (a file `switch-<id>.json`) and every
  joining rank is ready.

A switch, with the joining ranks' start-up hidden behind training:
1. rank 0 sees the order, opens the union world's TCPStore at the order's rendezvous and
   reports `preparing`; the joining ranks start (their agents got the same order), plan
   the switch, allocate and touch their new shards, then add themselves to the store's
   `joined` counter, and wait in init_process_group;
2. at the first step boundary where `joined` is complete, the old ranks agree, rank 0
   broadcasts the order, every old rank hands its state over, leaves the old world and
   joins the union world (ranks 0 .. max(old, new) - 1) on that store;
3. the engine moves the state (parallelism/engine/switch.py switch_state: plan fingerprints,
   rounds, digest verification); ranks outside the new layout exit, the others build the
   new layout's trainer and go on. Rank 0 reports `ready`, `transferring` and
   `committed` with the timings (prepare: order seen to all joined, hidden behind
   training; pause: last old step to the first new step; transfer; verify).

Rank 0 speaks for the job (JobReport / TransitionReport to the control queue); a rank that
fails exits non-zero with its traceback on stderr and its agent reports it, except when a
peer is lost while training: then it keeps its state and waits for a recovery order
(agents/runtime/orphan.py), and may go on as a rank of the survivors' world.
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from agents import protocol
from agents.runtime.job_settings import JobSettings, rank_trainer
from agents.runtime.rank_reports import Reporter
from agents.runtime.run_files import done_switches
from agents.runtime.step_boundary import signal_abort
from agents.runtime.switching import join_switch
from agents.runtime.train_loop import survive, train
from agents.runtime.worlds import backend


def freeze_imports() -> None:
    """Import what a rank runs, then move every object alive so far out of the garbage
    collector's reach (gc.freeze): a full collection then walks only the objects made since
    (the trainers, never frozen, so theirs are still collected). Measured on llama-124m: a
    collection that came during a switch's pause took 0.16-0.32 s walking torch's
    hundreds of thousands of module-level objects, 0.02 s after this."""
    import gc

    import torch.distributed.pipelining  # noqa: F401 (0.47 s here: in a pause it cost a switch into pp > 1 as much)

    import parallelism.engine.execute  # noqa: F401
    import agents.runtime.checkpoints  # noqa: F401
    import agents.runtime.orphan  # noqa: F401
    import parallelism.engine.switch  # noqa: F401
    import parallelism.training.run  # noqa: F401

    gc.collect()
    gc.freeze()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--abort"] and len(argv) == 3:  # run by an agent whose joining rank died
        signal_abort(protocol.JobSwitchOrder.model_validate_json(Path(argv[1]).read_text()), argv[2])
        return 0
    joining = argv[:1] == ["--join"]
    args = argv[1:] if joining else argv
    if len(args) != 2:
        print("usage: python -m agents.runtime.worker [--join] ORDER_JSON RANK", file=sys.stderr)
        return 2
    path, rank = Path(args[0]), int(args[1])
    started = time.perf_counter()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack to the rank log
    import torch

    torch.set_num_threads(int(os.environ.get("DYNAPLANE_RANK_THREADS", "1")))
    freeze_imports()
    node, broker = os.environ.get("DYNAPLANE_NODE", ""), os.environ.get("DYNAPLANE_BROKER_URL")
    if joining:
        order = protocol.JobSwitchOrder.model_validate_json(path.read_text())
        settings = JobSettings.of(order)
        reporter = Reporter(order.job_id, rank, node, broker, order.restore_id)
        trainer, ckpt = join_switch(order, rank, settings, path.parent, settings.checkpointer(rank))
        done = {order.transition_id}
        if trainer is None or not trainer.active:  # no rank of the new layout for this process
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            return 0
        rank = trainer.rank
    else:
        import torch.distributed as dist

        from parallelism.layout.placement import place
        from agents.runtime.checkpoints import restore
        from parallelism.training.loop import first_shards
        from parallelism.training.run import build_trainer

        order = protocol.JobStartOrder.model_validate_json(path.read_text())
        settings = JobSettings.of(order)
        reporter = Reporter(order.job_id, rank, node, broker, order.restore_id)
        ckpt = settings.checkpointer(rank)
        dist.init_process_group(backend(), init_method=f"tcp://{order.rendezvous}", rank=rank,
                                world_size=order.world, timeout=datetime.timedelta(seconds=order.timeout_seconds))
        placement = place(settings.tensors, order.layout)
        if order.restore_from:  # a restart after a failure: the state comes from the checkpoint
            loading = time.perf_counter()
            ckpt.prepare(placement, force=True)
            shards, scalars, verified = restore(settings.tensors, order.layout, rank, order.restore_from, ckpt.meshes)
            # (the meshes just built serve the periodic checkpoints of this world as well)
            trainer = build_trainer(settings.config(order.layout), order.layout, rank, shards, scalars)
            if rank == 0:
                reporter.job("restored", step=scalars.step, checkpoint_path=order.restore_from, verified=verified,
                             seconds=time.perf_counter() - loading, layout=order.layout)
        else:  # a Hugging Face model when init_from (each rank reads the boxes it holds), else the seeded init
            shards = first_shards(placement, rank, order.seed, order.init_from)
            trainer = rank_trainer(settings, order.layout, rank, shards, None, ckpt)
            del shards
        done = set()
        # (the first line of the rank's log, which the job page shows for rank 0)
        print(f"rank {rank}: training {order.layout} on {order.world} ranks, ready in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
    from agents.runtime.orphan import Orphaned

    steps, committed = 0, None
    while True:
        try:
            steps += train(trainer, settings, rank, path.parent, reporter, done, ckpt, committed)
            break
        except Orphaned as lost:
            orphan = lost.orphan
        trainer = None
        resumed = survive(orphan, settings, path.parent, node, broker)
        if resumed is None:
            print(f"rank {orphan.rank}: leaves after its world broke", file=sys.stderr)
            return 0
        trainer, settings, rank, reporter, ckpt, committed = resumed
        done = done_switches(path.parent)
    print(f"rank {rank}: {steps} steps in {time.perf_counter() - started:.1f} s", file=sys.stderr)
    return 0


def leave(code: int) -> None:
    """End the rank process without the interpreter's finalization: its exit handlers (the
    report batcher's last flush) run first, then os._exit. Gloo's C++ threads can outlive
    finalization and abort or crash a process whose run succeeded (pytorch#179291, #190489:
    seen here as exit codes -6 and -11 after the last step was reported)."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    leave(main(sys.argv[1:]))
